//! `cargo xtask demo --passthrough [--backend ebpf|iptables]`: capture alone, told to a
//! person. Two pods named after Istio's samples, `sleep` and `httpbin`; capture
//! and a proxy in each; calls that are captured and calls that are not; what the kernel
//! holds; and a clean-up that leaves nothing behind. Any surprise fails the demo.
//!
//! Guards clean up on failure too: `Capture` runs `--cleanup` in each pod and removes
//! the pin directory, the harness's `Node` kills the processes and removes the pods.

use std::net::{IpAddr, SocketAddr};
use std::process::Command;

use anyhow::{Context, Result, bail, ensure};
use harness::{Node, Pod, PodProcess};
use serde_json::Value;

use crate::pods::{
    APP_UID, Backend, Bins, Capture, PROXY_UID, access_log, call, log_entry, secs, start_app,
    start_proxy,
};

/// The demo's own pin root: it never touches a real install under /sys/fs/bpf/shunt.
const PIN_ROOT: &str = "/sys/fs/bpf/shunt-demo";
const PORT: u16 = 8080;

pub(super) fn run(backend: Backend) -> Result<()> {
    let bins = Bins::build(false)?;

    heading(1, "A node with two pods: sleep and httpbin");
    let mut node = Node::new()?;
    let sleep = node.add_pod("sleep")?;
    let httpbin = node.add_pod("httpbin")?;
    println!("Each pod is a network namespace and a cgroup, joined to one bridge:");
    for pod in [&sleep, &httpbin] {
        println!(
            "  {:<8} {:<12} {:<18} cgroup {}",
            pod.name(),
            pod.ipv4(),
            pod.ipv6(),
            pod.cgroup_path().display()
        );
    }
    println!("\nThe apps: testapp serve answers `HELLO peer=<who it sees> local=..`, then echoes.");
    let listen = [
        "serve".into(),
        "--listen".into(),
        format!("0.0.0.0:{PORT}"),
        "--listen".into(),
        format!("[::]:{PORT}"),
    ];
    let mut apps = Vec::new();
    for pod in [&httpbin, &sleep] {
        prompt(pod, None, "testapp", &listen);
        apps.push(start_app(&bins, pod, PORT)?);
    }
    let httpbin_app = &apps[0];

    heading(
        2,
        &format!("Capture with {} and a proxy in each pod", backend.title()),
    );
    let mut capture = Capture::new(&bins, backend, PIN_ROOT);
    if backend == Backend::Iptables {
        println!(
            "What istio-init would write (shunt capture --dry-run): istio-iptables' own rules"
        );
        prompt(&sleep, None, "shunt", &capture.args(&sleep, &["--dry-run"]));
        print_indented(&capture.run(&sleep, &["--dry-run"])?);
    }
    println!(
        "istio-init's job, with istio-iptables' default flags (-p 15001 -z 15006 -u 1337 ...):"
    );
    for pod in [&sleep, &httpbin] {
        prompt(pod, None, "shunt", &capture.args(pod, &[]));
        print_indented(&capture.install(pod)?);
    }
    println!(
        "\nThe proxy's job (Envoy's): listen on 15001 (outbound) and 15006 (inbound), then run as uid 1337:"
    );
    let mut proxies = Vec::new();
    for pod in [&sleep, &httpbin] {
        prompt(pod, None, "shunt", &["proxy".into()]);
        proxies.push(start_proxy(&bins, pod)?);
    }
    let (sleep_proxy, httpbin_proxy) = (&proxies[0], &proxies[1]);

    heading(3, "Traffic");
    captured_calls(
        &bins,
        &sleep,
        &httpbin,
        sleep_proxy,
        httpbin_proxy,
        httpbin_app,
    )?;
    uncaptured_calls(&bins, &sleep, &httpbin, sleep_proxy, httpbin_proxy)?;

    heading(4, "Looking inside");
    match backend {
        Backend::Ebpf => look_inside_ebpf(&bins, &sleep, &httpbin)?,
        Backend::Iptables => look_inside_iptables(&sleep, &httpbin)?,
    }

    heading(5, "Clean up");
    for (pod, said) in capture.cleanup()? {
        prompt(&pod, None, "shunt", &capture.args(&pod, &["--cleanup"]));
        print_indented(&said);
    }
    drop(proxies);
    drop(apps);
    let leftovers: Vec<_> = [sleep.netns_path(), httpbin.netns_path(), node.cgroup_path()]
        .into_iter()
        .chain((backend == Backend::Ebpf).then(|| PIN_ROOT.into()))
        .collect();
    drop(node);
    println!("Stopped the proxies and apps, removed the pods (network namespaces and cgroups).");
    for path in &leftovers {
        ensure!(!path.exists(), "{} is still there", path.display());
        println!("  gone: {}", path.display());
    }
    println!("\nThe demo is over; nothing is left behind.");
    Ok(())
}

/// sleep's app calls httpbin over IPv4 and IPv6: out through sleep's proxy, in through
/// httpbin's, to httpbin's app from 127.0.0.6 / ::6.
fn captured_calls(
    bins: &Bins,
    sleep: &Pod,
    httpbin: &Pod,
    sleep_proxy: &PodProcess,
    httpbin_proxy: &PodProcess,
    httpbin_app: &PodProcess,
) -> Result<()> {
    let targets = [
        (IpAddr::from(httpbin.ipv4()), "IPv4", "127.0.0.6"),
        (IpAddr::from(httpbin.ipv6()), "IPv6", "::6"),
    ];
    for (ip, family, passthrough) in targets {
        let target = SocketAddr::new(ip, PORT);
        println!("sleep's app (uid {APP_UID}) calls httpbin over {family}:");
        let c = call_shown(bins, sleep, APP_UID, target)?;
        let seen = httpbin_app.wait_for_stdout(
            |l| l.starts_with("ACCEPT") && l.contains(&format!("peer={} ", c.server_peer)),
            secs(5),
        )?;
        println!("    httpbin's app printed: {seen}");
        ensure!(
            c.server_peer.ip().to_string() == passthrough,
            "httpbin's app saw {}, not {passthrough}: the call did not come through httpbin's proxy",
            c.server_peer
        );
        println!(
            "    {} bytes came back intact; {passthrough} is the inbound passthrough source: the call went through both proxies.",
            c.bytes
        );
        let out = log_entry(sleep_proxy, c.client_local)
            .context("sleep's proxy wrote no access-log line for the call")?;
        ensure!(out["direction"] == "outbound", "sleep's proxy logged {out}");
        let hop: SocketAddr = out["upstream_local_address"]
            .as_str()
            .and_then(|s| s.parse().ok())
            .with_context(|| format!("no upstream_local_address in {out}"))?;
        let inb = log_entry(httpbin_proxy, hop)
            .context("httpbin's proxy wrote no access-log line for the call")?;
        ensure!(
            inb["direction"] == "inbound",
            "httpbin's proxy logged {inb}"
        );
        println!("    access log of sleep's proxy:   {}", compact(&out));
        println!("    access log of httpbin's proxy: {}", compact(&inb));
        if c.client_local.ip().is_loopback() {
            println!(
                "    (the app's socket is on loopback: connect{} turned its connect into one to the proxy's :15001 there)",
                if target.is_ipv4() { 4 } else { 6 }
            );
        }
    }
    Ok(())
}

/// Two calls capture leaves alone: the app to its own pod, and the proxy's uid.
fn uncaptured_calls(
    bins: &Bins,
    sleep: &Pod,
    httpbin: &Pod,
    sleep_proxy: &PodProcess,
    httpbin_proxy: &PodProcess,
) -> Result<()> {
    println!(
        "\nNot captured: sleep's app calls its own pod's address (istio-iptables' rules 17/20):"
    );
    let c = call_shown(
        bins,
        sleep,
        APP_UID,
        SocketAddr::new(sleep.ipv4().into(), PORT),
    )?;
    std::thread::sleep(std::time::Duration::from_millis(300)); // time for a stray log line
    ensure!(
        c.server_peer == c.client_local,
        "sleep's app saw {} but the caller was {}: something sat in between",
        c.server_peer,
        c.client_local
    );
    ensure!(
        no_entry(sleep_proxy, c.client_local),
        "sleep's proxy logged the call"
    );
    println!(
        "    sleep's app saw {} = the caller's own socket: no proxy in between, no access-log line.",
        c.server_peer
    );

    println!(
        "\nNot captured: the proxy's own uid ({PROXY_UID}) in sleep calls httpbin (rules 18/21):"
    );
    let target = SocketAddr::new(httpbin.ipv4().into(), PORT);
    let c = call_shown(bins, sleep, PROXY_UID, target)?;
    let inb = log_entry(httpbin_proxy, c.client_local)
        .context("httpbin's proxy wrote no access-log line for the call")?;
    ensure!(
        no_entry(sleep_proxy, c.client_local),
        "sleep's proxy logged the call"
    );
    println!(
        "    sleep's proxy has no line for {}: the connection went straight out of sleep.",
        c.client_local
    );
    println!(
        "    httpbin still captured it inbound (its app saw {}):",
        c.server_peer
    );
    println!("    access log of httpbin's proxy: {}", compact(&inb));
    Ok(())
}

fn look_inside_ebpf(bins: &Bins, sleep: &Pod, httpbin: &Pod) -> Result<()> {
    println!(
        "shunt inspect reads the pins: pods, links, inbound listeners and one counter per decision:"
    );
    let inspect = ["inspect", "--bpffs", PIN_ROOT];
    println!("  host$ shunt {}", inspect.join(" "));
    print_indented(&host(Command::new(&bins.shunt).args(inspect))?);

    println!("\nThe same state with bpftool (the pins live under {PIN_ROOT}):");
    let sleep_cg = sleep.cgroup_path().display().to_string();
    let cgroup_show = ["cgroup", "show", sleep_cg.as_str()];
    let pod_config = format!("{PIN_ROOT}/POD_CONFIG");
    let map_dump = ["map", "dump", "pinned", pod_config.as_str()];
    let listing = [
        (
            format!("bpftool cgroup show {sleep_cg}"),
            "connect4/6, getsockopt, sock_ops on sleep's cgroup",
        ),
        (
            format!("bpftool cgroup show {}", httpbin.cgroup_path().display()),
            "the same on httpbin's",
        ),
        (
            "bpftool link".into(),
            "and the sk_lookup link of each pod's network namespace",
        ),
        (
            format!("ls {PIN_ROOT}/pods/"),
            "one folder of link pins per captured pod",
        ),
        (
            format!("bpftool map dump pinned {pod_config}"),
            "netns cookie -> pod settings",
        ),
        (
            format!("bpftool map dump pinned {PIN_ROOT}/POD_ADDRS"),
            "pod address -> pod",
        ),
        (
            format!("bpftool map dump pinned {PIN_ROOT}/ORIG_DST_TUPLE"),
            "live redirected connections -> original destination",
        ),
        (
            format!("bpftool map dump pinned {PIN_ROOT}/COUNTERS"),
            "per-CPU decision counters",
        ),
    ];
    for (cmd, what) in &listing {
        println!("  {cmd:<78} # {what}");
    }
    for args in [&cgroup_show[..], &map_dump[..]] {
        println!("\n  host$ bpftool {}", args.join(" "));
        print_indented(&host(Command::new("bpftool").args(args))?);
    }
    Ok(())
}

fn look_inside_iptables(sleep: &Pod, httpbin: &Pod) -> Result<()> {
    println!(
        "The nat rules live in each pod's network namespace; their packet counters show which matched:"
    );
    for (pod, chain) in [(sleep, "ISTIO_OUTPUT"), (httpbin, "ISTIO_INBOUND")] {
        let args = ["-t", "nat", "-L", chain, "-n", "-v", "--line-numbers"];
        prompt_named(pod.name(), None, "iptables", &args);
        print_indented(&crate::pods::run(pod.command("iptables").args(args))?);
    }
    Ok(())
}

/// `testapp call TARGET --bytes 1024`, shown as typed, with its result.
fn call_shown(bins: &Bins, pod: &Pod, uid: u32, target: SocketAddr) -> Result<crate::pods::Call> {
    let args = [
        "call".to_string(),
        target.to_string(),
        "--bytes".into(),
        "1024".into(),
    ];
    prompt(pod, Some(uid), "testapp", &args);
    let c = call(bins, pod, uid, target, 1024)?;
    println!(
        "    client socket {} -> server saw peer {} local {}",
        c.client_local, c.server_peer, c.server_local
    );
    Ok(c)
}

fn no_entry(proxy: &PodProcess, client: SocketAddr) -> bool {
    let key = client.to_string();
    !access_log(proxy)
        .iter()
        .any(|v| v["downstream_remote_address"] == key.as_str())
}

/// One access-log entry on one line: direction, downstream -> original destination,
/// the upstream connection, bytes.
fn compact(v: &Value) -> String {
    let s = |k: &str| match &v[k] {
        Value::String(s) => s.clone(),
        Value::Null => "-".into(),
        other => other.to_string(),
    };
    let flags = s("response_flags");
    format!(
        "{:<8} {} -> {}  upstream {} {} -> {}  {} B in, {} B out{}",
        s("direction"),
        s("downstream_remote_address"),
        s("original_dst"),
        s("upstream_cluster"),
        s("upstream_local_address"),
        s("upstream_host"),
        s("bytes_received"),
        s("bytes_sent"),
        if flags == "-" {
            String::new()
        } else {
            format!("  flags {flags}")
        }
    )
}

/// Runs a command on the host (not in a pod); returns stdout and stderr.
pub(super) fn host(cmd: &mut Command) -> Result<String> {
    let out = cmd.output().with_context(|| format!("running {cmd:?}"))?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if !out.status.success() {
        bail!("{cmd:?} failed ({}):\n{text}", out.status);
    }
    Ok(text)
}

pub(super) fn heading(n: u32, title: &str) {
    let line = format!("{n}. {title}");
    println!("\n{line}\n{}", "=".repeat(line.len()));
}

pub(super) fn prompt(pod: &Pod, uid: Option<u32>, program: &str, args: &[String]) {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    prompt_named(pod.name(), uid, program, &args);
}

/// `  [pod sleep, uid 1000]$ program args`: what runs where.
pub(super) fn prompt_named(pod: &str, uid: Option<u32>, program: &str, args: &[&str]) {
    let who = uid.map_or(String::new(), |u| format!(", uid {u}"));
    println!("  [pod {pod}{who}]$ {program} {}", args.join(" "));
}

pub(super) fn print_indented(text: &str) {
    for line in text.trim_end().lines() {
        println!("    {line}");
    }
}
