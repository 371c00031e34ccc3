//! `cargo xtask bench node --upgrade`: what clients see while node mode is upgraded.
//! Two pods, the client's app holding N long-lived connections to the server's echo
//! (round trips on each in turn) while another app loops new connections; meanwhile
//! the node process is replaced, either by a hand-over (the new process takes the
//! pods' listening sockets and the established flows, `--take-over`) or by stopping
//! the old process and starting a new one that enrolls the pods again. Reported per
//! way and N: connections refused, long-lived connections broken, the longest round
//! trip (the stall a client saw), round trips made. Pods fail closed. Results in
//! `target/bench/node-upgrade.{txt,json}`.

use std::fmt::Write as _;
use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result};
use harness::Node;
use serde_json::{Value, json};

use super::measure::{app_testapp, save};
use super::node::Agent;
use crate::pods::{Bins, start_app};

const PORT: u16 = 8080;
/// How long the clients run; the upgrade starts a third of the way in.
const CLIENT_MS: u64 = 9000;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Way {
    HandOver,
    StopThenStart,
}

impl Way {
    fn name(self) -> &'static str {
        match self {
            Way::HandOver => "hand-over",
            Way::StopThenStart => "stop-then-start",
        }
    }
}

pub fn run(bins: &Bins, nodeserve: &Path, connections: &[usize]) -> Result<()> {
    let mut text = String::new();
    let mut runs = Vec::new();
    writeln!(
        text,
        "bench node --upgrade: clients between two pods while the node process is replaced \
         ({CLIENT_MS} ms of load, fail-closed pods)"
    )?;
    writeln!(
        text,
        "{:>6}  {:<16}{:>10}{:>12}{:>10}{:>16}{:>14}",
        "N", "way", "refused", "connects", "broken", "longest RT ms", "round trips"
    )?;
    for &n in connections {
        for way in [Way::HandOver, Way::StopThenStart] {
            let r = upgrade(bins, nodeserve, n, way)
                .with_context(|| format!("{} with {n} connections", way.name()))?;
            writeln!(
                text,
                "{:>6}  {:<16}{:>10}{:>12}{:>10}{:>16.1}{:>14}",
                n,
                way.name(),
                count(&r["connect"]["errors"]),
                count(&r["connect"]["connections"]),
                count(&r["hold"]["broken"]),
                r["hold"]["longest_round_trip_us"]
                    .as_f64()
                    .unwrap_or(f64::NAN)
                    / 1000.0,
                count(&r["hold"]["round_trips"]),
            )?;
            runs.push(json!({"connections": n, "way": way.name(), "report": r}));
        }
    }
    print!("{text}");
    save("node-upgrade", &text, &json!({ "runs": runs }))
}

/// A count from a client's report ("-" if it is missing).
fn count(v: &Value) -> String {
    v.as_u64().map_or("-".into(), |n| n.to_string())
}

/// One upgrade under load; the clients' two reports.
fn upgrade(bins: &Bins, nodeserve: &Path, n: usize, way: Way) -> Result<Value> {
    let mut node = Node::new()?;
    let client = node.add_pod("client")?;
    let server = node.add_pod("server")?;
    let _app = start_app(bins, &server, PORT)?;
    let flags = ["--drain-time-s".to_owned(), "1".to_owned()];
    let mut old = Agent::start_with(&node, nodeserve, "upgrade", &flags)?;
    old.add(&client)?;
    old.add(&server)?;
    let target = format!("{}:{PORT}", server.ipv4());
    let (hold, connect, new) = std::thread::scope(|s| -> Result<_> {
        let hold = s.spawn(|| {
            app_testapp(
                bins,
                &client,
                &[
                    "hold",
                    &target,
                    "--connections",
                    &n.to_string(),
                    "--duration-ms",
                    &CLIENT_MS.to_string(),
                    "--payload",
                    "64",
                ],
                CLIENT_MS,
            )
        });
        let connect = s.spawn(|| {
            app_testapp(
                bins,
                &client,
                &[
                    "bench-connect",
                    &target,
                    "--duration-ms",
                    &CLIENT_MS.to_string(),
                    "--concurrency",
                    "2",
                ],
                CLIENT_MS,
            )
        });
        // Opening N connections takes a moment; the upgrade starts once they run.
        std::thread::sleep(Duration::from_millis(CLIENT_MS / 3));
        let new = match way {
            Way::HandOver => {
                let socket = std::env::temp_dir()
                    .join(format!("shunt-bench-upgrade-{}.sock", std::process::id()));
                old.send(&format!("handover {}", socket.display()))?;
                let take = ["--take-over".to_owned(), socket.display().to_string()];
                let new =
                    Agent::start_with(&node, nodeserve, "upgrade", &[&flags[..], &take].concat())?;
                old.wait_handed_over()?;
                // Its flows are parked and sent; what else it had drains for 1 s.
                std::thread::sleep(Duration::from_secs(1));
                old.stop_leaving_pins();
                new
            }
            Way::StopThenStart => {
                old.stop_leaving_pins();
                let mut new = Agent::start_with(&node, nodeserve, "upgrade", &flags)?;
                new.add(&client)?;
                new.add(&server)?;
                new
            }
        };
        let hold = hold.join().expect("the hold client")?;
        let connect = connect.join().expect("the connect client")?;
        Ok((hold, connect, new))
    })?;
    drop(new);
    Ok(json!({"hold": hold, "connect": connect}))
}
