//! `shunt-cni`: a chained CNI plugin (spec 1.0) that enrolls each pod with the node
//! agent. ADD sends the pod (its `CNI_ARGS`, netns and the previous result's IPs) with
//! the netns fd attached and prints the previous result unchanged; DEL withdraws it;
//! CHECK asks whether it is served; VERSION lists the versions we speak.
//!
//! Network configuration keys of our own (beside `cniVersion`, `name`, `type`):
//! - `agent_socket`: the node agent's socket (default [`DEFAULT_SOCKET`]);
//! - `agent_unavailable`: `fail` (default) or `pass`: what ADD and CHECK do when the
//!   agent cannot be reached (DEL always succeeds: the agent drops pods whose netns is
//!   gone when it starts again);
//! - `exclude_namespaces`: pods of these namespaces are passed through untouched
//!   (default `["kube-system"]`);
//! - `agent_timeout_seconds`: how long to wait for the agent's answer (default 30).
//! - `agent_wait_seconds`: how long ADD and CHECK wait for an agent that is not
//!   listening (being restarted or upgraded) before `agent_unavailable` applies
//!   (default 15; DEL never waits).

use std::collections::BTreeMap;
use std::io::Read;
use std::net::IpAddr;
use std::os::fd::{AsFd, OwnedFd};
use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;
use serde_json::{Value, json};

use crate::PodInfo;
use crate::enroll::wire::{self, CniRequest, CniResponse};

/// Where `shunt node` listens for the plugin by default.
pub const DEFAULT_SOCKET: &str = "/var/run/shunt/cni.sock";

/// The versions this plugin accepts in `cniVersion` (results since 0.3.0 share the
/// `ips[].address` shape we read).
pub const SUPPORTED_VERSIONS: &[&str] = &["0.3.0", "0.3.1", "0.4.0", "1.0.0"];

/// The CNI spec's error codes we use.
mod code {
    pub const INCOMPATIBLE_VERSION: u32 = 1;
    pub const INVALID_ENV: u32 = 4;
    pub const IO_FAILURE: u32 = 5;
    pub const DECODE_FAILURE: u32 = 6;
    pub const INVALID_CONFIG: u32 = 7;
    pub const TRY_AGAIN_LATER: u32 = 11;
    /// Plugin-specific (100+): the agent refused the pod or does not serve it.
    pub const AGENT_REFUSED: u32 = 100;
}

/// A CNI error: printed on stdout as the spec's error object, exit status 1.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CniError {
    pub code: u32,
    pub msg: String,
    pub details: String,
}

impl CniError {
    fn new(code: u32, msg: impl Into<String>, details: impl Into<String>) -> Self {
        Self {
            code,
            msg: msg.into(),
            details: details.into(),
        }
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AgentUnavailable {
    #[default]
    Fail,
    Pass,
}

/// The network configuration on stdin.
#[derive(Debug, Deserialize)]
struct NetConf {
    #[serde(rename = "cniVersion")]
    cni_version: String,
    #[serde(rename = "prevResult")]
    prev_result: Option<Value>,
    agent_socket: Option<PathBuf>,
    #[serde(default)]
    agent_unavailable: AgentUnavailable,
    exclude_namespaces: Option<Vec<String>>,
    agent_timeout_seconds: Option<u64>,
    agent_wait_seconds: Option<u64>,
    /// What the runtime passes for the capabilities the conflist declares: `dns` is
    /// the pod's resolv.conf (containerd fills it from the pod's DNS config).
    #[serde(rename = "runtimeConfig", default)]
    runtime_config: RuntimeConfig,
}

#[derive(Debug, Default, Deserialize)]
struct RuntimeConfig {
    dns: Option<crate::PodDns>,
}

/// What a run prints and how it exits.
#[derive(Debug, PartialEq, Eq)]
pub struct Outcome {
    pub stdout: String,
    pub success: bool,
}

/// Runs the plugin as the runtime invoked it (environment and stdin).
pub fn main() -> std::process::ExitCode {
    let env: BTreeMap<String, String> = std::env::vars().collect();
    let mut stdin = Vec::new();
    let outcome = match std::io::stdin().read_to_end(&mut stdin) {
        Ok(_) => run(&env, &stdin),
        Err(e) => error_outcome(
            "1.0.0",
            CniError::new(code::IO_FAILURE, "reading stdin", e.to_string()),
        ),
    };
    print!("{}", outcome.stdout);
    if outcome.success {
        std::process::ExitCode::SUCCESS
    } else {
        std::process::ExitCode::FAILURE
    }
}

/// The plugin: `env` holds the `CNI_*` variables, `stdin` the network configuration.
pub fn run(env: &BTreeMap<String, String>, stdin: &[u8]) -> Outcome {
    // The version errors are reported in: the configuration's if it parses.
    let version = serde_json::from_slice::<Value>(stdin)
        .ok()
        .and_then(|v| v.get("cniVersion")?.as_str().map(str::to_owned))
        .unwrap_or_else(|| "1.0.0".into());
    match command(env, stdin) {
        Ok(stdout) => Outcome {
            stdout,
            success: true,
        },
        Err(e) => error_outcome(&version, e),
    }
}

fn error_outcome(version: &str, e: CniError) -> Outcome {
    let mut body = json!({"cniVersion": version, "code": e.code, "msg": e.msg});
    if !e.details.is_empty() {
        body["details"] = e.details.into();
    }
    Outcome {
        stdout: body.to_string(),
        success: false,
    }
}

fn command(env: &BTreeMap<String, String>, stdin: &[u8]) -> Result<String, CniError> {
    let var = |name: &str| env.get(name).map(String::as_str).filter(|v| !v.is_empty());
    let required = |name: &str| {
        var(name).ok_or_else(|| {
            CniError::new(
                code::INVALID_ENV,
                format!("{name} is not set"),
                "the container runtime sets it for this command",
            )
        })
    };
    let cmd = required("CNI_COMMAND")?;
    if cmd == "VERSION" {
        return Ok(
            json!({"cniVersion": "1.0.0", "supportedVersions": SUPPORTED_VERSIONS}).to_string(),
        );
    }
    if !matches!(cmd, "ADD" | "DEL" | "CHECK") {
        return Err(CniError::new(
            code::INVALID_ENV,
            format!("CNI_COMMAND {cmd:?} is not one of ADD, DEL, CHECK, VERSION"),
            "",
        ));
    }
    let conf: NetConf = serde_json::from_slice(stdin).map_err(|e| {
        CniError::new(
            code::DECODE_FAILURE,
            "the network configuration on stdin does not decode",
            e.to_string(),
        )
    })?;
    if !SUPPORTED_VERSIONS.contains(&conf.cni_version.as_str()) {
        return Err(CniError::new(
            code::INCOMPATIBLE_VERSION,
            format!("cniVersion {} is not supported", conf.cni_version),
            format!("supported: {}", SUPPORTED_VERSIONS.join(", ")),
        ));
    }
    let container_id = required("CNI_CONTAINERID")?.to_owned();
    let args = parse_cni_args(var("CNI_ARGS").unwrap_or(""));
    let k8s = |key: &str| args.get(key).cloned().filter(|v| !v.is_empty());
    let namespace = k8s("K8S_POD_NAMESPACE");
    let excluded = namespace.as_ref().is_some_and(|ns| {
        conf.exclude_namespaces
            .as_deref()
            .unwrap_or(&["kube-system".to_owned()])
            .contains(ns)
    });
    let uid = k8s("K8S_POD_UID");
    let passthrough = || -> Result<String, CniError> {
        Ok(conf
            .prev_result
            .as_ref()
            .map(Value::to_string)
            .unwrap_or_default())
    };
    let agent = Agent {
        socket: conf
            .agent_socket
            .clone()
            .unwrap_or_else(|| DEFAULT_SOCKET.into()),
        timeout: Duration::from_secs(conf.agent_timeout_seconds.unwrap_or(30)),
        wait: Duration::ZERO,
    };
    let waiting = Agent {
        wait: Duration::from_secs(conf.agent_wait_seconds.unwrap_or(15)),
        ..agent.clone()
    };
    match cmd {
        "ADD" => {
            let prev = conf.prev_result.as_ref().ok_or_else(|| {
                CniError::new(
                    code::INVALID_CONFIG,
                    "no prevResult: shunt-cni is chained after the primary plugin",
                    "",
                )
            })?;
            // Not a Kubernetes pod (no K8S_POD_*), or an excluded namespace: untouched.
            let (Some(namespace), Some(name)) = (namespace, k8s("K8S_POD_NAME")) else {
                return passthrough();
            };
            if excluded {
                return passthrough();
            }
            let netns_path = PathBuf::from(required("CNI_NETNS")?);
            let netns = std::fs::File::open(&netns_path)
                .map(OwnedFd::from)
                .map_err(|e| {
                    CniError::new(
                        code::INVALID_ENV,
                        format!("CNI_NETNS {}: {e}", netns_path.display()),
                        "",
                    )
                })?;
            let pod = PodInfo {
                uid: uid.unwrap_or_else(|| container_id.clone()),
                name,
                namespace,
                container_id,
                netns_path: Some(netns_path),
                ips: result_ips(prev)?,
                service_account: None,
                dns: conf.runtime_config.dns.clone(),
                token_path: None,
            };
            waiting.ask(
                &CniRequest::Add { pod },
                Some(netns),
                conf.agent_unavailable,
            )?;
            Ok(prev.to_string())
        }
        "DEL" => {
            if !excluded {
                // A DEL must succeed when there is nothing left to remove.
                let _ = agent.ask(
                    &CniRequest::Del { uid, container_id },
                    None,
                    AgentUnavailable::Pass,
                );
            }
            Ok(String::new())
        }
        _ => {
            if !excluded && namespace.is_some() {
                required("CNI_NETNS")?;
                waiting.ask(
                    &CniRequest::Check { uid, container_id },
                    None,
                    conf.agent_unavailable,
                )?;
            }
            Ok(String::new())
        }
    }
}

/// `CNI_ARGS`: `KEY=VALUE` pairs separated by `;`.
fn parse_cni_args(args: &str) -> BTreeMap<String, String> {
    args.split(';')
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
        .collect()
}

/// The pod's addresses: `prevResult.ips[].address` (CIDR notation).
fn result_ips(prev: &Value) -> Result<Vec<IpAddr>, CniError> {
    let Some(ips) = prev.get("ips") else {
        return Ok(Vec::new());
    };
    let ips = ips
        .as_array()
        .ok_or_else(|| CniError::new(code::INVALID_CONFIG, "prevResult.ips is not a list", ""))?;
    ips.iter()
        .enumerate()
        .map(|(i, ip)| {
            let address = ip.get("address").and_then(Value::as_str).ok_or_else(|| {
                CniError::new(
                    code::INVALID_CONFIG,
                    format!("prevResult.ips[{i}].address is missing or not a string"),
                    "",
                )
            })?;
            address
                .split('/')
                .next()
                .and_then(|a| a.parse().ok())
                .ok_or_else(|| {
                    CniError::new(
                        code::INVALID_CONFIG,
                        format!("prevResult.ips[{i}].address {address:?} is not an IP/prefix"),
                        "",
                    )
                })
        })
        .collect()
}

#[derive(Clone)]
struct Agent {
    socket: PathBuf,
    timeout: Duration,
    /// How long to retry connecting while nothing listens on `socket`.
    wait: Duration,
}

impl Agent {
    /// One request, one answer. An agent that cannot be reached is an error or not per
    /// `unavailable`; an agent that answers with an error always is one.
    fn ask(
        &self,
        request: &CniRequest,
        netns: Option<OwnedFd>,
        unavailable: AgentUnavailable,
    ) -> Result<(), CniError> {
        let response = match self.exchange(request, netns) {
            Ok(r) => r,
            Err(e) if unavailable == AgentUnavailable::Pass => {
                eprintln!(
                    "shunt-cni: node agent unavailable, passing (agent_unavailable: pass): {e}"
                );
                return Ok(());
            }
            Err(e) => {
                return Err(CniError::new(
                    code::TRY_AGAIN_LATER,
                    format!(
                        "the shunt node agent at {} is unavailable",
                        self.socket.display()
                    ),
                    e.to_string(),
                ));
            }
        };
        if response.error.is_empty() {
            Ok(())
        } else {
            Err(CniError::new(
                code::AGENT_REFUSED,
                "the shunt node agent refused",
                response.error,
            ))
        }
    }

    fn exchange(
        &self,
        request: &CniRequest,
        netns: Option<OwnedFd>,
    ) -> std::io::Result<CniResponse> {
        let conn = self.connect()?;
        conn.set_read_timeout(Some(self.timeout))?;
        conn.set_write_timeout(Some(self.timeout))?;
        let json = serde_json::to_vec(request).map_err(std::io::Error::other)?;
        wire::send(conn.as_fd(), &json, netns.as_ref().map(AsFd::as_fd))?;
        let packet = wire::recv(conn.as_fd())?;
        if packet.bytes.is_empty() {
            return Err(std::io::Error::other("the agent closed without answering"));
        }
        serde_json::from_slice(&packet.bytes).map_err(std::io::Error::other)
    }
}

impl Agent {
    /// Connects, retrying while the socket is missing or refuses (an agent between two
    /// processes) for at most `wait`: a pod created during an agent's restart waits for
    /// it rather than failing or passing uncaptured.
    fn connect(&self) -> std::io::Result<std::os::unix::net::UnixStream> {
        use std::io::ErrorKind::{ConnectionRefused, NotFound};
        let deadline = std::time::Instant::now() + self.wait;
        loop {
            match wire::connect(&self.socket) {
                Err(e)
                    if matches!(e.kind(), NotFound | ConnectionRefused)
                        && std::time::Instant::now() < deadline =>
                {
                    std::thread::sleep(Duration::from_millis(100));
                }
                other => return other,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_runtimes_dns_capability_is_read_from_runtime_config() {
        let conf: NetConf = serde_json::from_str(
            r#"{"cniVersion": "1.0.0", "runtimeConfig": {"dns": {"servers": ["10.96.0.10"],
                "searches": ["shop.svc.cluster.local"], "options": ["ndots:5"]}}}"#,
        )
        .unwrap();
        let dns = conf.runtime_config.dns.unwrap();
        assert_eq!(
            dns.servers,
            ["10.96.0.10".parse::<std::net::IpAddr>().unwrap()]
        );
        assert_eq!(dns.searches, ["shop.svc.cluster.local"]);
        let without: NetConf = serde_json::from_str(r#"{"cniVersion": "1.0.0"}"#).unwrap();
        assert!(without.runtime_config.dns.is_none());
    }

    #[test]
    fn cni_args_are_split_on_semicolons() {
        let args = parse_cni_args(
            "IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME=web-0;K8S_POD_UID=abc-1",
        );
        assert_eq!(args["K8S_POD_NAME"], "web-0");
        assert_eq!(args["K8S_POD_UID"], "abc-1");
    }

    #[test]
    fn result_ips_read_addresses_and_name_a_bad_one() {
        let prev = json!({"ips": [{"address": "10.1.0.5/24"}, {"address": "fd00::5/64"}]});
        assert_eq!(
            result_ips(&prev).unwrap(),
            vec![
                "10.1.0.5".parse::<IpAddr>().unwrap(),
                "fd00::5".parse().unwrap()
            ]
        );
        let bad = json!({"ips": [{"address": "10.1.0.5/24"}, {"address": "nope"}]});
        let e = result_ips(&bad).unwrap_err();
        assert!(e.msg.contains("prevResult.ips[1].address"), "{e:?}");
    }
}
