//! Reading what the node's programs report: `testapp call`'s JSON line and the proxy's
//! JSON access log. One definition, used by the tests, the demo and the benchmarks.

use std::{net::SocketAddr, time::Duration};

use anyhow::{Context, Result, bail};
use serde_json::Value;

use crate::PodProcess;

/// What `testapp call` reports: both ends of the connection as each side saw them.
#[derive(Debug, Clone)]
pub struct Call {
    pub client_local: SocketAddr,
    pub server_peer: SocketAddr,
    pub server_local: SocketAddr,
    pub bytes: u64,
    /// The client socket's `SO_COOKIE` (0 from a testapp that does not say).
    pub cookie: u64,
}

impl Call {
    /// Parses `testapp call`'s stdout; `what` names the call in errors.
    pub fn parse(stdout: &str, what: &str) -> Result<Call> {
        let v: Value = serde_json::from_str(stdout.trim())
            .with_context(|| format!("{what} printed {stdout:?}"))?;
        if v["ok"] != true {
            bail!("{what} failed: {}", v["error"]);
        }
        let addr = |k: &str| -> Result<SocketAddr> {
            v[k].as_str()
                .and_then(|s| s.parse().ok())
                .with_context(|| format!("{what}: no {k} in {v}"))
        };
        Ok(Call {
            client_local: addr("client_local")?,
            server_peer: addr("server_peer")?,
            server_local: addr("server_local")?,
            bytes: v["bytes"].as_u64().unwrap_or(0),
            cookie: v["cookie"].as_u64().unwrap_or(0),
        })
    }
}

/// The proxy's access log so far: one JSON object per connection.
pub fn access_log(proxy: &PodProcess) -> Vec<Value> {
    proxy
        .stdout_text()
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v.get("direction").is_some())
        .collect()
}

/// The access-log entry whose downstream is `client`, waiting for it up to `timeout`
/// (the line is written when the connection ends).
pub fn access_log_entry(
    proxy: &PodProcess,
    client: SocketAddr,
    timeout: Duration,
) -> Option<Value> {
    let key = client.to_string();
    let line = proxy
        .wait_for_stdout(
            |l| {
                serde_json::from_str::<Value>(l)
                    .is_ok_and(|v| v["downstream_remote_address"] == key.as_str())
            },
            timeout,
        )
        .ok()?;
    serde_json::from_str(&line).ok()
}
