//! `cargo xtask bench agent`: one `shunt agent` (agent and proxy in one process) against
//! pilot-agent's shape (Envoy plus an agent process: `shunt agent --proxy envoy`), each
//! started in a fresh pod from Istio's own bootstrap (`default_golden.json`, its xDS
//! socket moved to a scratch folder) with N EDS clusters (and their endpoints) and one
//! listener waiting in the ADS server.
//!
//! Per proxy and round: seconds from spawning the agent to 15021 `/healthz/ready`
//! answering 200 (Istio's bootstrap serves 15021 itself: the in-process proxy's admin,
//! or Envoy's listener routed to the agent's 15020), then, a second later, the RSS of
//! the agent process plus its children (Envoy). Results: medians, the shunt/pilot-shape
//! ratios, `target/bench/agent.txt` / `agent.json`.

use std::fmt::Write as _;
use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use harness::ads::resources::named;
use harness::ads::resources::tcp_proxy_listener;
use harness::ads::{AdsServer, Listen, type_urls};
use harness::{Node, Pod, PodProcess};
use serde_json::json;

use super::measure::{KIB_PER_MIB, median, rss, save};
use super::xds::{assignment, cluster};
use crate::pods::Bins;

#[derive(clap::Args)]
pub struct AgentArgs {
    /// EDS clusters in the first push.
    #[arg(long, default_value_t = 1_000)]
    clusters: usize,
    /// Rounds of both (the order alternates); medians are reported.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
}

#[derive(Clone, Copy, PartialEq)]
enum Shape {
    /// `shunt agent`: the proxy in process.
    Shunt,
    /// `shunt agent --proxy envoy`: pilot-agent's shape, Envoy beside an agent.
    PilotShape,
}

impl Shape {
    fn name(self) -> &'static str {
        match self {
            Shape::Shunt => "shunt agent",
            Shape::PilotShape => "agent + Envoy",
        }
    }
}

struct Run {
    ready_s: f64,
    rss_mib: f64,
    /// The agent process alone (the same as `rss_mib` for the in-process proxy).
    agent_rss_mib: f64,
}

pub fn run(bins: Bins, args: &AgentArgs) -> Result<()> {
    let envoy = crate::setup::envoy()?;
    let golden = crate::workspace_root().join("tests/fixtures/istio/bootstrap/default_golden.json");
    let golden = std::fs::read_to_string(&golden)
        .with_context(|| format!("reading {}", golden.display()))?;
    let mut results: Vec<(Shape, Run)> = Vec::new();
    for round in 0..args.rounds {
        let order = if round % 2 == 0 {
            [Shape::Shunt, Shape::PilotShape]
        } else {
            [Shape::PilotShape, Shape::Shunt]
        };
        for shape in order {
            let run = measure(&bins, &envoy, &golden, shape, args.clusters)?;
            println!(
                "round {round}: {:<14} ready in {:.3} s, RSS {:.1} MiB (agent process {:.1})",
                shape.name(),
                run.ready_s,
                run.rss_mib,
                run.agent_rss_mib
            );
            results.push((shape, run));
        }
    }
    let of = |shape: Shape, f: fn(&Run) -> f64| {
        median(
            results
                .iter()
                .filter(|(s, _)| *s == shape)
                .map(|(_, r)| f(r)),
        )
    };
    let (shunt_ready, pilot_ready) = (
        of(Shape::Shunt, |r| r.ready_s),
        of(Shape::PilotShape, |r| r.ready_s),
    );
    let (shunt_rss, pilot_rss) = (
        of(Shape::Shunt, |r| r.rss_mib),
        of(Shape::PilotShape, |r| r.rss_mib),
    );
    let mut text = String::new();
    writeln!(
        text,
        "bench agent: Istio's bootstrap, first push of {} EDS clusters, medians of {} rounds\n",
        args.clusters, args.rounds
    )?;
    writeln!(
        text,
        "| | shunt agent | agent + Envoy | shunt / pilot shape |"
    )?;
    writeln!(text, "|---|---|---|---|")?;
    writeln!(
        text,
        "| start to 15021 ready (s) | {shunt_ready:.3} | {pilot_ready:.3} | {:.2} |",
        shunt_ready / pilot_ready
    )?;
    writeln!(
        text,
        "| RSS, all processes (MiB) | {shunt_rss:.1} | {pilot_rss:.1} | {:.2} |",
        shunt_rss / pilot_rss
    )?;
    writeln!(
        text,
        "| of which the agent process (MiB) | {:.1} | {:.1} | |",
        of(Shape::Shunt, |r| r.agent_rss_mib),
        of(Shape::PilotShape, |r| r.agent_rss_mib)
    )?;
    print!("{text}");
    let runs: Vec<_> = results
        .iter()
        .map(|(s, r)| {
            json!({"proxy": s.name(), "ready_s": r.ready_s, "rss_mib": r.rss_mib,
                   "agent_rss_mib": r.agent_rss_mib})
        })
        .collect();
    save(
        "agent",
        &text,
        &json!({"clusters": args.clusters, "rounds": args.rounds, "runs": runs}),
    )
}

fn measure(bins: &Bins, envoy: &Path, golden: &str, shape: Shape, clusters: usize) -> Result<Run> {
    let dir = std::env::temp_dir().join(format!("shunt-bench-agent-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    let socket = dir.join("XDS");
    let config = dir.join("envoy-rev.json");
    std::fs::write(
        &config,
        golden
            .replace("/tmp/XDS", &socket.display().to_string())
            .replace(
                "./var/run/secrets/workload-spiffe-uds/test.sock",
                &dir.join("SDS").display().to_string(),
            ),
    )?;
    let server = AdsServer::start(Listen::Unix(socket.clone()))?;
    open_to_the_proxy(&socket)?;
    let endpoint = Ipv4Addr::LOCALHOST;
    server.set(
        type_urls::CLUSTER,
        "1",
        (0..clusters).map(cluster).collect(),
    );
    server.set(
        type_urls::ENDPOINT,
        "1",
        (0..clusters)
            .map(|i| assignment(i, endpoint, &[9000]))
            .collect(),
    );
    let at = SocketAddr::from(([127, 0, 0, 1], 20000));
    server.set(
        type_urls::LISTENER,
        "1",
        vec![named("l0", &tcp_proxy_listener("l0", at, "c00000"))],
    );

    let mut node = Node::new()?;
    let pod = node.add_pod("agent")?;
    let mut command = pod.command(&bins.shunt).arg("agent").arg("-c").arg(&config);
    if shape == Shape::PilotShape {
        command = command
            .args(["--proxy", "envoy", "--envoy-binary"])
            .arg(envoy);
    }
    let start = Instant::now();
    let agent = command.spawn()?;
    let deadline = start + Duration::from_secs(120);
    while ready_status(&pod)? != 200 {
        if let Some(status) = agent.try_wait() {
            bail!(
                "{}: the agent exited ({status}): {}",
                shape.name(),
                agent.stderr_text()
            );
        }
        if Instant::now() > deadline {
            bail!(
                "{}: not ready in 120 s: {}",
                shape.name(),
                agent.stderr_text()
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let ready_s = start.elapsed().as_secs_f64();
    std::thread::sleep(Duration::from_secs(1));
    let (agent_kib, total_kib) = tree_rss_kib(&agent)?;
    let (rss_mib, agent_rss_mib) = (
        total_kib as f64 / KIB_PER_MIB,
        agent_kib as f64 / KIB_PER_MIB,
    );
    drop(agent);
    server.stop();
    let _ = std::fs::remove_dir_all(&dir);
    Ok(Run {
        ready_s,
        rss_mib,
        agent_rss_mib,
    })
}

/// The agent's RSS, and with its children's (Envoy), KiB.
fn tree_rss_kib(agent: &PodProcess) -> Result<(u64, u64)> {
    let mut pids = vec![agent.pid()];
    for task in std::fs::read_dir(format!("/proc/{}/task", agent.pid()))?.flatten() {
        if let Ok(children) = std::fs::read_to_string(task.path().join("children")) {
            pids.extend(
                children
                    .split_whitespace()
                    .filter_map(|p| p.parse::<u32>().ok()),
            );
        }
    }
    let agent_kib = rss(agent.pid())?.0;
    let mut total = 0;
    for pid in pids {
        total += rss(pid)?.0;
    }
    Ok((agent_kib, total))
}

/// 15021 `/healthz/ready`'s status, 0 if nothing answers.
fn ready_status(pod: &Pod) -> Result<u16> {
    pod.run_in_netns(|| {
        let Ok(mut stream) = TcpStream::connect(("127.0.0.1", 15021)) else {
            return 0;
        };
        let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
        let request = "GET /healthz/ready HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n";
        if stream.write_all(request.as_bytes()).is_err() {
            return 0;
        }
        let mut answer = String::new();
        let _ = stream.read_to_string(&mut answer);
        answer
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or(0)
    })
}

fn open_to_the_proxy(socket: &Path) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    for path in [socket.parent().expect("a folder"), socket] {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o777))
            .with_context(|| format!("chmod 777 {}", path.display()))?;
    }
    Ok(())
}
