//! `shunt capture` as an operator meets it: the seed's rules in a dry run, bad input
//! refused with the flag named and nothing installed, the auto backend falling back
//! and saying why, and `--cleanup` leaving no program attached and no pin behind.

mod support;

use std::path::Path;

use harness::{Node, Pod, shunt_bin};
use serde_json::Value;
use support::*;

/// The `-A` rules of SEEDS.md section 2, normalised: the checked-in copy
/// (tests/fixtures/SOURCES.md), so the test does not depend on the shared folder. They
/// come from Istio 1.6-1.14; today's istio-iptables (whose goldens shunt matches, see
/// `iptables_goldens.rs`) writes them with three differences, applied here: the HBONE
/// tunnel port 15008 returns first in ISTIO_INBOUND and is left out of the proxy's
/// loopback redirect, OUTPUT jumps for every protocol, and 22 is no longer excluded.
fn seed_rules() -> Vec<String> {
    let text = include_str!("fixtures/istio-iptables-seed.rules");
    let seed = text
        .lines()
        .map(|l| {
            l.trim()
                .trim_start_matches(|c: char| c.is_ascii_digit())
                .trim()
        })
        .filter(|l| l.starts_with("-A"))
        .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
        .filter(|l| l != "-A ISTIO_INBOUND -p tcp --dport 22 -j RETURN")
        .map(|l| {
            let l = l.replace("-A OUTPUT -p tcp -j", "-A OUTPUT -j");
            ["--uid-owner", "--gid-owner"].iter().fold(l, |l, owner| {
                l.replace(
                    &format!("-m owner {owner} 1337 -j ISTIO_IN_REDIRECT"),
                    &format!("-p tcp ! --dport 15008 -m owner {owner} 1337 -j ISTIO_IN_REDIRECT"),
                )
            })
        });
    std::iter::once("-A ISTIO_INBOUND -p tcp --dport 15008 -j RETURN".to_owned())
        .chain(seed)
        .collect()
}

#[test]
fn dry_run_with_seed_flags_prints_the_seed_rules_as_istio_iptables_writes_them_today() {
    let out = std::process::Command::new(shunt_bin())
        .args(["capture", "--backend", "iptables", "--dry-run"])
        .args([
            "-p",
            "15001",
            "-z",
            "15006",
            "-u",
            "1337",
            "-m",
            "REDIRECT",
            "-i",
            "*",
            "-x",
            "",
            "-b",
            "*",
            "-d",
            "15090,15021,15020",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    let v4 = text.split("# ip6tables-restore").next().unwrap();
    let rules: Vec<String> = v4
        .lines()
        .filter(|l| l.starts_with("-A"))
        .map(String::from)
        .collect();
    assert_eq!(rules, seed_rules());
    assert!(
        text.contains("-A ISTIO_OUTPUT -o lo -s ::6/128 -j RETURN"),
        "IPv6 rules follow"
    );
}

fn capture_in(pod: &Pod, bpffs: &Path, args: &[&str]) -> std::process::Output {
    pod.command(shunt_bin())
        .arg("capture")
        .arg("--bpffs")
        .arg(bpffs)
        .args(args)
        .output()
        .unwrap()
}

fn stderr(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn iptables_chains(pod: &Pod) -> String {
    run_ok(pod.command("iptables").args(["-w", "-t", "nat", "-S"]))
        + &run_ok(pod.command("ip6tables").args(["-w", "-t", "nat", "-S"]))
}

/// `bpftool -j ARGS`: its output, after checking that it succeeded. A listing that
/// raced another process's link or program going away (`can't get link by id`) is
/// taken again: the kernel's objects are not this test's alone.
fn bpftool(args: &[&std::ffi::OsStr]) -> String {
    let run = || {
        std::process::Command::new("bpftool")
            .arg("-j")
            .args(args)
            .output()
            .expect("running bpftool")
    };
    let mut out = run();
    for _ in 0..5 {
        let raced = String::from_utf8_lossy(&out.stdout).contains("can't get ");
        if out.status.success() || !raced {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
        out = run();
    }
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "bpftool -j {args:?}: {}\nstdout: {stdout}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// bpftool's JSON list; anything else fails the test with what it printed (an empty
/// list is never assumed).
fn json_list(args: &[&std::ffi::OsStr], stdout: &str) -> Vec<Value> {
    match serde_json::from_str::<Value>(stdout) {
        Ok(Value::Array(items)) => items,
        other => panic!("bpftool -j {args:?} printed no JSON list ({other:?}):\n{stdout:?}"),
    }
}

fn cgroup_programs(pod: &Pod) -> Vec<Value> {
    let cgroup = pod.cgroup_path();
    let args = ["cgroup".as_ref(), "show".as_ref(), cgroup.as_os_str()];
    let stdout = bpftool(&args);
    // bpftool prints a bare line break, not `[]`, for a cgroup with no program
    // (bpftool v7.x, Debian).
    if stdout == "\n" {
        return Vec::new();
    }
    json_list(&args, &stdout)
}

fn sk_lookup_links_for(pod: &Pod) -> usize {
    use std::os::unix::fs::MetadataExt;
    let ino = std::fs::metadata(pod.netns_path()).unwrap().ino();
    let args = ["link".as_ref(), "show".as_ref()];
    let links = json_list(&args, &bpftool(&args));
    links
        .iter()
        .filter(|l| l["netns_ino"].as_u64() == Some(ino))
        .count()
}

#[test]
fn bad_input_is_refused_naming_the_problem_and_installs_nothing() {
    let mut node = Node::new().unwrap();
    let pod = node.add_pod("a").unwrap();
    let bpffs = bpffs_root("bad-input");
    let cg = pod.cgroup_path();
    let cg = cg.to_str().unwrap();
    let cases: [(&[&str], &[&str]); 17] = [
        (
            &["--backend", "ebpf", "--cgroup", cg, "-x", "10.0.0.0/33"],
            &["-x", "10.0.0.0/33", "0..=32"],
        ),
        (
            &["--backend", "auto", "--cgroup", cg, "-i", "10.0.0/8"],
            &["-i", "'10.0.0/8'"],
        ),
        (
            &["--backend", "iptables", "-d", "15090,http"],
            &["-d", "'http'"],
        ),
        (
            &["--backend", "ebpf", "--cgroup", cg, "-p", "70000"],
            &["-p", "'70000'"],
        ),
        (
            &["--backend", "auto", "--cgroup", "/nonexistent/pod"],
            &["--cgroup /nonexistent/pod", "no such directory"],
        ),
        (
            &["--backend", "ebpf", "--cgroup", "/tmp"],
            &[
                "--cgroup /tmp",
                "not a cgroup v2 directory",
                "cgroup2 is mounted at",
            ],
        ),
        (&["--backend", "ebpf"], &["--backend ebpf needs --cgroup"]),
        (&["--backend", "iptables", "-u", "1337,x"], &["-u", "'x'"]),
        (
            &["--backend", "iptables", "-k", "eth/1"],
            &["-k", "'eth/1'"],
        ),
        (&["--backend", "iptables", "-q", "0"], &["-q", "'0'"]),
        (&["--backend", "iptables", "-t", "mark"], &["-t", "'mark'"]),
        (
            &["--backend", "iptables", "--redirect-dns=maybe"],
            &["--redirect-dns", "'maybe'"],
        ),
        (
            &["--backend", "iptables", "--dns-servers-v4", "fd00::1"],
            &["--dns-servers-v4", "'fd00::1'", "other IP family"],
        ),
        (
            &[
                "--backend",
                "iptables",
                "--redirect-dns",
                "--resolv-conf",
                "/nonexistent/resolv.conf",
            ],
            &["--redirect-dns", "/nonexistent/resolv.conf"],
        ),
        (
            &[
                "--backend",
                "iptables",
                "--host-ipv4-loopback-cidr",
                "10.0.0.1/8",
            ],
            &["--host-ipv4-loopback-cidr", "'10.0.0.1/8'", "loopback"],
        ),
        (
            &["--backend", "iptables", "--probe-timeout", "soon"],
            &["--probe-timeout", "'soon'"],
        ),
        (
            &[
                "--backend",
                "ebpf",
                "--cgroup",
                cg,
                "-c",
                "eth1",
                "--drop-invalid",
            ],
            &[
                "--backend ebpf",
                "does not implement -c, --drop-invalid",
                "--backend iptables",
            ],
        ),
    ];
    for (args, expected) in cases {
        let out = capture_in(&pod, &bpffs, args);
        let err = stderr(&out);
        assert!(!out.status.success(), "{args:?} should fail");
        for needle in expected {
            assert!(
                err.contains(needle),
                "{args:?}: error should mention {needle:?}: {err}"
            );
        }
        assert!(!err.contains("panicked"), "{err}");
        assert!(!bpffs.exists(), "{args:?} left pins behind");
        assert!(
            cgroup_programs(&pod).is_empty(),
            "{args:?} left programs attached"
        );
        assert!(
            !iptables_chains(&pod).contains("ISTIO_"),
            "{args:?} left iptables rules"
        );
    }
}

#[test]
fn without_cap_bpf_ebpf_fails_clearly_and_auto_falls_back_to_iptables() {
    let mut node = Node::new().unwrap();
    let pod = node.add_pod("a").unwrap();
    let bpffs = bpffs_root("nocap");
    let _guard = Capture {
        backend: "auto",
        bpffs: bpffs.clone(),
    };
    let without_bpf_caps = |backend: &str| {
        let inner = format!(
            "exec {} capture --backend {backend} --bpffs {} --cgroup {}",
            shunt_bin().display(),
            bpffs.display(),
            pod.cgroup_path().display()
        );
        pod.command("capsh")
            .args([
                "--drop=cap_bpf,cap_sys_admin,cap_perfmon",
                "--",
                "-c",
                &inner,
            ])
            .output()
            .unwrap()
    };

    let out = without_bpf_caps("ebpf");
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(
        err.contains("CAP_BPF"),
        "names the missing capability: {err}"
    );
    assert!(
        err.contains("rolled back") || !bpffs.join("pods").exists(),
        "{err}"
    );
    assert!(cgroup_programs(&pod).is_empty());
    assert!(
        !bpffs.join("pods").exists()
            || std::fs::read_dir(bpffs.join("pods"))
                .unwrap()
                .next()
                .is_none()
    );

    let out = without_bpf_caps("auto");
    let err = stderr(&out);
    assert!(out.status.success(), "auto should fall back: {err}");
    assert!(
        err.contains("eBPF capture unavailable") && err.contains("falling back to iptables"),
        "{err}"
    );
    assert!(iptables_chains(&pod).contains("-A ISTIO_OUTPUT -j ISTIO_REDIRECT"));

    let out = capture_in(&pod, &bpffs, &["--cleanup"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(!iptables_chains(&pod).contains("ISTIO_"));
}

#[test]
fn ebpf_install_is_visible_to_bpftool_and_cleanup_leaves_nothing() {
    let mut node = Node::new().unwrap();
    let pod = node.add_pod("a").unwrap();
    let capture = Capture::new("ebpf", "lifecycle");
    capture.install(&pod, &[]);

    let attached: Vec<String> = cgroup_programs(&pod)
        .iter()
        .filter_map(|p| p["name"].as_str().map(String::from))
        .collect();
    for name in [
        "capture_connect4",
        "capture_connect6",
        "original_dst",
        "track_sockets",
    ] {
        assert!(
            attached.iter().any(|a| a == name),
            "{name} not attached: {attached:?}"
        );
    }
    assert!(
        !attached.iter().any(|a| a.contains("dns")),
        "DNS programs attached without --redirect-dns: {attached:?}"
    );
    assert_eq!(
        sk_lookup_links_for(&pod),
        1,
        "sk_lookup attached to the pod's netns"
    );

    // Maps pretty-print through BTF: field names, not hex.
    let dump = std::process::Command::new("bpftool")
        .args(["-j", "map", "dump", "pinned"])
        .arg(capture.bpffs.join("POD_CONFIG"))
        .output()
        .unwrap();
    let entries: Vec<Value> = serde_json::from_slice(&dump.stdout).unwrap();
    assert_eq!(entries.len(), 1);
    assert_eq!(entries[0]["formatted"]["value"]["outbound_port"], 15001);
    assert_eq!(entries[0]["formatted"]["value"]["proxy_uid"], 1337);

    // shunt inspect asks the kernel where each link is attached.
    let out = std::process::Command::new(shunt_bin())
        .args(["inspect", "--json", "--bpffs"])
        .arg(&capture.bpffs)
        .output()
        .unwrap();
    let state: Value = serde_json::from_slice(&out.stdout).unwrap();
    let links: Vec<String> = state["pods"][0]["links"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l.as_str().unwrap().to_string())
        .collect();
    let cg = pod.cgroup_path();
    assert!(
        links.contains(&format!("capture_connect4 -> cgroup {}", cg.display())),
        "{links:?}"
    );
    assert!(
        links.contains(&format!("track_sockets -> cgroup {}", cg.display())),
        "{links:?}"
    );
    {
        use std::os::unix::fs::MetadataExt;
        let ino = std::fs::metadata(pod.netns_path()).unwrap().ino();
        assert!(
            links.contains(&format!("steer_inbound -> netns {ino}")),
            "{links:?}"
        );
    }

    // A second install in the same namespace is refused and the first keeps working.
    let again = capture.command(&pod, &[]).output().unwrap();
    assert!(!again.status.success());
    assert!(
        stderr(&again).contains("already installed"),
        "{}",
        stderr(&again)
    );
    assert_eq!(sk_lookup_links_for(&pod), 1);

    capture.cleanup(&pod);
    assert!(
        cgroup_programs(&pod).is_empty(),
        "programs still attached after cleanup"
    );
    assert_eq!(
        sk_lookup_links_for(&pod),
        0,
        "sk_lookup still attached after cleanup"
    );
    assert!(
        !capture.bpffs.exists(),
        "pins left under {}",
        capture.bpffs.display()
    );
}

#[test]
fn maps_pinned_by_an_incompatible_build_are_refused_and_left_alone() {
    let mut node = Node::new().unwrap();
    let pod = node.add_pod("a").unwrap();
    let capture = Capture::new("ebpf", "incompatible");
    std::fs::create_dir_all(&capture.bpffs).unwrap();
    // An older layout: POD_CONFIG with a 24-byte value.
    let foreign = capture.bpffs.join("POD_CONFIG");
    let made = std::process::Command::new("bpftool")
        .args(["map", "create"])
        .arg(&foreign)
        .args([
            "type",
            "hash",
            "key",
            "8",
            "value",
            "24",
            "entries",
            "16",
            "name",
            "POD_CONFIG",
        ])
        .status()
        .unwrap();
    assert!(made.success());

    let out = capture.command(&pod, &[]).output().unwrap();
    let err = stderr(&out);
    assert!(!out.status.success());
    assert!(
        err.contains("incompatible shunt") && err.contains("value 24 B"),
        "{err}"
    );
    assert!(cgroup_programs(&pod).is_empty(), "nothing attached");
    assert_eq!(sk_lookup_links_for(&pod), 0);
    assert!(
        foreign.exists(),
        "the other build's map is not ours to remove"
    );
    assert!(!capture.bpffs.join("pods").exists());
}

const DNS_PROGRAMS: [&str; 4] = [
    "capture_dns4",
    "capture_dns6",
    "restore_dns_reply4",
    "restore_dns_reply6",
];

#[test]
fn dns_capture_attaches_its_programs_lists_the_resolvers_and_cleanup_takes_them_away() {
    let mut node = Node::new().unwrap();
    let pod = node.add_pod("a").unwrap();
    let dir = TempDir::new("lifecycle-dns");
    let resolv = dir.0.join("resolv.conf");
    std::fs::write(
        &resolv,
        "search svc.cluster.local\nnameserver 10.96.0.10\nnameserver fd00::a\n",
    )
    .unwrap();
    let capture = Capture::new("ebpf", "lifecycle-dns");

    let plan = capture
        .command(&pod, &["--redirect-dns", "--dry-run"])
        .resolv_conf(&resolv)
        .output()
        .unwrap();
    let plan = String::from_utf8_lossy(&plan.stdout);
    for name in DNS_PROGRAMS {
        assert!(plan.contains(&format!("attach {name} to cgroup")), "{plan}");
    }
    assert!(plan.contains("DNS_SERVERS[10.96.0.10]"), "{plan}");
    assert!(plan.contains("DNS_SERVERS[fd00::a]"), "{plan}");
    assert!(!capture.bpffs.exists(), "a dry run pins nothing");

    let out = capture
        .command(&pod, &["--redirect-dns"])
        .resolv_conf(&resolv)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let attached: Vec<String> = cgroup_programs(&pod)
        .iter()
        .filter_map(|p| p["name"].as_str().map(String::from))
        .collect();
    for name in DNS_PROGRAMS
        .iter()
        .chain(&["capture_connect4", "capture_connect6"])
    {
        assert!(
            attached.iter().any(|a| a == name),
            "{name} not attached: {attached:?}"
        );
    }
    let inspect = std::process::Command::new(shunt_bin())
        .args(["inspect", "--bpffs"])
        .arg(&capture.bpffs)
        .output()
        .unwrap();
    let inspect = String::from_utf8_lossy(&inspect.stdout);
    assert!(
        inspect.contains("DNS capture: port 53 of 10.96.0.10, fd00::a -> :15053")
            || inspect.contains("DNS capture: port 53 of fd00::a, 10.96.0.10 -> :15053"),
        "{inspect}"
    );
    assert!(
        inspect.contains("restore_dns_reply6 -> cgroup"),
        "{inspect}"
    );

    capture.cleanup(&pod);
    assert!(
        cgroup_programs(&pod).is_empty(),
        "programs still attached after cleanup"
    );
    assert!(
        !capture.bpffs.exists(),
        "pins left under {}",
        capture.bpffs.display()
    );
}
