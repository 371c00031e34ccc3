//! Active health checking (Envoy's cluster `health_checks`): every `interval`, each host
//! is probed, by a TCP connect (optionally sending bytes and expecting others back) or
//! an HTTP/1.1 `GET path` that must answer an expected status (200 by default).
//!
//! `unhealthy_threshold` failures in a row take a host out of load balancing and
//! `healthy_threshold` successes bring it back, as in Envoy, with Envoy's two
//! exceptions: a host never checked yet turns healthy on its first success (so a new
//! cluster need not wait `healthy_threshold` intervals), and an HTTP answer with an
//! unexpected status marks it unhealthy at once (the host answered, and said no).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::ops::Range;
use std::sync::Weak;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::cluster::Cluster;
use super::connect::connect;
use super::host::FAILED_ACTIVE_HC;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HealthCheck {
    pub timeout: Duration,
    pub interval: Duration,
    /// Envoy's `interval_jitter`: up to this much added to every interval.
    pub interval_jitter: Duration,
    /// Envoy's `interval_jitter_percent`: up to this share of `interval` added too.
    pub interval_jitter_percent: u32,
    /// Envoy's `initial_jitter`: up to this much wait before the first probe.
    pub initial_jitter: Duration,
    pub unhealthy_threshold: u32,
    pub healthy_threshold: u32,
    pub checker: Checker,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Checker {
    Tcp {
        send: Option<Vec<u8>>,
        /// Each must appear in the answer, in order; none means connect-only.
        receive: Vec<Vec<u8>>,
    },
    Http {
        /// The Host header; the cluster's name when empty, as Envoy.
        host: String,
        path: String,
        expected_statuses: Vec<Range<u16>>,
    },
}

impl HealthCheck {
    /// The wait before the next round: the interval plus both jitters, so that proxies
    /// (and clusters) started together do not probe in lockstep.
    pub fn next_interval(&self) -> Duration {
        let percent = self.interval * self.interval_jitter_percent / 100;
        self.interval + up_to(percent) + up_to(self.interval_jitter)
    }

    #[cfg(test)]
    pub fn tcp_for_tests() -> Self {
        HealthCheck {
            timeout: Duration::from_secs(1),
            interval: Duration::from_secs(60),
            interval_jitter: Duration::ZERO,
            interval_jitter_percent: 0,
            initial_jitter: Duration::ZERO,
            unhealthy_threshold: 2,
            healthy_threshold: 2,
            checker: Checker::Tcp {
                send: None,
                receive: Vec::new(),
            },
        }
    }
}

/// What one probe found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    Healthy,
    /// No answer, or not the expected one: counts toward `unhealthy_threshold`.
    Failed,
    /// An HTTP status outside the expected ones: unhealthy at once.
    Unhealthy,
}

/// One host's run of results.
#[derive(Debug, Default, Clone, Copy)]
pub struct Streak {
    checked: bool,
    successes: u32,
    failures: u32,
}

impl Streak {
    /// Records a probe's outcome for a host currently `healthy`; returns its new health
    /// if that changes.
    pub fn record(&mut self, outcome: Outcome, healthy: bool, check: &HealthCheck) -> Option<bool> {
        let first = !self.checked;
        self.checked = true;
        match outcome {
            Outcome::Healthy => {
                self.failures = 0;
                self.successes += 1;
                (!healthy && (first || self.successes >= check.healthy_threshold)).then_some(true)
            }
            Outcome::Failed | Outcome::Unhealthy => {
                self.successes = 0;
                self.failures += 1;
                (healthy
                    && (outcome == Outcome::Unhealthy
                        || self.failures >= check.unhealthy_threshold))
                    .then_some(false)
            }
        }
    }
}

/// A random duration in `[0, max)`.
fn up_to(max: Duration) -> Duration {
    let nanos = u64::try_from(max.as_nanos()).unwrap_or(u64::MAX);
    if nanos == 0 {
        return Duration::ZERO;
    }
    Duration::from_nanos(fastrand::u64(..nanos))
}

/// Probes the cluster's hosts with its `index`th health check until the cluster is gone.
pub async fn run(cluster: Weak<Cluster>, index: usize) {
    let mut streaks: HashMap<SocketAddr, Streak> = HashMap::new();
    let initial = cluster
        .upgrade()
        .map(|c| up_to(c.health_checks[index].initial_jitter));
    if let Some(initial) = initial.filter(|d| !d.is_zero()) {
        tokio::time::sleep(initial).await;
    }
    loop {
        let Some(strong) = cluster.upgrade() else {
            return;
        };
        let check = strong.health_checks[index].clone();
        let hosts = strong.hosts();
        let name = strong.name.clone();
        let source = strong.source_address;
        // No strong reference while probing or sleeping: the cluster may go away.
        drop(strong);

        let mut probes = tokio::task::JoinSet::new();
        for host in hosts {
            let (check, name) = (check.clone(), name.clone());
            probes.spawn(async move {
                let outcome = probe(&check, host.address, source, &name).await;
                (host, outcome)
            });
        }
        let mut changed = false;
        while let Some(Ok((host, outcome))) = probes.join_next().await {
            let healthy = !host.has_flag(FAILED_ACTIVE_HC);
            let streak = streaks.entry(host.address).or_default();
            if let Some(now_healthy) = streak.record(outcome, healthy, &check) {
                tracing::info!(cluster = %name, host = %host.address, healthy = now_healthy, ?outcome, "active health check changed a host's health");
                changed |= host.set_flag(FAILED_ACTIVE_HC, !now_healthy);
            }
        }
        if changed && let Some(cluster) = cluster.upgrade() {
            streaks.retain(|addr, _| cluster.hosts().iter().any(|h| h.address == *addr));
            cluster.refresh();
        }
        tokio::time::sleep(check.next_interval()).await;
    }
}

/// One probe of one host, within the check's timeout.
pub async fn probe(
    check: &HealthCheck,
    host: SocketAddr,
    source: Option<SocketAddr>,
    cluster_name: &str,
) -> Outcome {
    let run = async {
        let mut stream = connect(host, source, check.timeout).await.ok()?;
        Some(match &check.checker {
            Checker::Tcp { send, receive } => {
                if let Some(send) = send {
                    stream.write_all(send).await.ok()?;
                }
                if receive_all(&mut stream, receive).await {
                    Outcome::Healthy
                } else {
                    Outcome::Failed
                }
            }
            Checker::Http {
                host: host_header,
                path,
                expected_statuses,
            } => {
                let host_header = if host_header.is_empty() {
                    cluster_name
                } else {
                    host_header
                };
                let request = format!(
                    "GET {path} HTTP/1.1\r\nHost: {host_header}\r\nUser-Agent: Envoy/HC\r\n\
                     Connection: close\r\n\r\n"
                );
                stream.write_all(request.as_bytes()).await.ok()?;
                let status = read_status(&mut stream).await?;
                if expected_statuses
                    .iter()
                    .any(|range| range.contains(&status))
                {
                    Outcome::Healthy
                } else {
                    Outcome::Unhealthy
                }
            }
        })
    };
    match tokio::time::timeout(check.timeout, run).await {
        Ok(Some(outcome)) => outcome,
        _ => Outcome::Failed,
    }
}

/// Reads until every expected payload has appeared in order (or EOF).
async fn receive_all(stream: &mut tokio::net::TcpStream, expected: &[Vec<u8>]) -> bool {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        if contains_in_order(&got, expected) {
            return true;
        }
        match stream.read(&mut buf).await {
            Ok(0) | Err(_) => return false,
            Ok(n) => got.extend_from_slice(&buf[..n]),
        }
        if got.len() > 64 * 1024 {
            return false;
        }
    }
}

fn contains_in_order(haystack: &[u8], needles: &[Vec<u8>]) -> bool {
    let mut rest = haystack;
    for needle in needles {
        match rest
            .windows(needle.len().max(1))
            .position(|w| w == needle.as_slice())
        {
            Some(at) => rest = &rest[at + needle.len()..],
            None => return false,
        }
    }
    true
}

/// The status code of an HTTP/1.x response's status line.
async fn read_status(stream: &mut tokio::net::TcpStream) -> Option<u16> {
    let mut got = Vec::new();
    let mut buf = [0u8; 1024];
    while !got.windows(2).any(|w| w == b"\r\n") {
        let n = stream.read(&mut buf).await.ok()?;
        if n == 0 || got.len() > 8192 {
            return None;
        }
        got.extend_from_slice(&buf[..n]);
    }
    parse_status_line(&got)
}

pub fn parse_status_line(bytes: &[u8]) -> Option<u16> {
    let line = bytes.split(|&b| b == b'\r').next()?;
    let line = std::str::from_utf8(line).ok()?;
    let mut parts = line.splitn(3, ' ');
    if !parts.next()?.starts_with("HTTP/1.") {
        return None;
    }
    parts.next()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU16, Ordering};

    use tokio::net::TcpListener;

    use crate::cluster::ClusterConfig;
    use crate::host::Host;

    fn check(unhealthy: u32, healthy: u32) -> HealthCheck {
        HealthCheck {
            unhealthy_threshold: unhealthy,
            healthy_threshold: healthy,
            ..HealthCheck::tcp_for_tests()
        }
    }

    #[test]
    fn intervals_carry_both_jitters() {
        let check = HealthCheck {
            interval: Duration::from_secs(1),
            interval_jitter: Duration::from_millis(100),
            interval_jitter_percent: 50,
            ..HealthCheck::tcp_for_tests()
        };
        let waits: Vec<Duration> = (0..200).map(|_| check.next_interval()).collect();
        let (min, max) = (waits.iter().min().unwrap(), waits.iter().max().unwrap());
        assert!(*min >= Duration::from_secs(1) && *max < Duration::from_millis(1600));
        assert!(
            *max - *min > Duration::from_millis(100),
            "jittered: {min:?}..{max:?}"
        );
        assert_eq!(
            HealthCheck::tcp_for_tests().next_interval(),
            Duration::from_secs(60),
            "no jitter configured, none added"
        );
    }

    #[test]
    fn thresholds_count_runs_and_the_first_success_counts_at_once() {
        let check = check(2, 3);
        let mut streak = Streak::default();
        // Never checked: one success is enough.
        assert_eq!(streak.record(Outcome::Healthy, false, &check), Some(true));
        assert_eq!(streak.record(Outcome::Failed, true, &check), None);
        assert_eq!(streak.record(Outcome::Healthy, true, &check), None);
        assert_eq!(streak.record(Outcome::Failed, true, &check), None);
        assert_eq!(streak.record(Outcome::Failed, true, &check), Some(false));
        assert_eq!(streak.record(Outcome::Healthy, false, &check), None);
        assert_eq!(streak.record(Outcome::Healthy, false, &check), None);
        assert_eq!(streak.record(Outcome::Healthy, false, &check), Some(true));
        // A bad HTTP status does not wait for the threshold.
        assert_eq!(streak.record(Outcome::Unhealthy, true, &check), Some(false));
    }

    #[test]
    fn status_lines_parse() {
        assert_eq!(parse_status_line(b"HTTP/1.1 200 OK\r\n"), Some(200));
        assert_eq!(
            parse_status_line(b"HTTP/1.0 503 Service Unavailable\r\n"),
            Some(503)
        );
        assert_eq!(parse_status_line(b"SSH-2.0-OpenSSH\r\n"), None);
    }

    /// An HTTP server answering every request with the status in `status`.
    async fn http_server(status: Arc<AtomicU16>) -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            loop {
                let (mut stream, _) = listener.accept().await.unwrap();
                let code = status.load(Ordering::Relaxed);
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 4096];
                    let mut got = Vec::new();
                    while !got.windows(4).any(|w| w == b"\r\n\r\n") {
                        let n = stream.read(&mut buf).await.unwrap();
                        if n == 0 {
                            return;
                        }
                        got.extend_from_slice(&buf[..n]);
                    }
                    assert!(got.starts_with(b"GET /healthz HTTP/1.1\r\n"));
                    let reply = format!("HTTP/1.1 {code} X\r\ncontent-length: 0\r\n\r\n");
                    let _ = stream.write_all(reply.as_bytes()).await;
                });
            }
        });
        addr
    }

    fn http_check() -> HealthCheck {
        HealthCheck {
            checker: Checker::Http {
                host: String::new(),
                path: "/healthz".into(),
                expected_statuses: std::iter::once(200..201).collect(),
            },
            ..check(1, 1)
        }
    }

    #[tokio::test]
    async fn http_probes_want_the_expected_status() {
        let status = Arc::new(AtomicU16::new(200));
        let addr = http_server(status.clone()).await;
        let check = http_check();
        assert_eq!(probe(&check, addr, None, "c").await, Outcome::Healthy);
        status.store(503, Ordering::Relaxed);
        assert_eq!(probe(&check, addr, None, "c").await, Outcome::Unhealthy);
    }

    #[tokio::test]
    async fn tcp_probes_connect_and_match_the_answer() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            loop {
                let (mut stream, _) = listener.accept().await.unwrap();
                let mut buf = [0u8; 4];
                if stream.read_exact(&mut buf).await.is_ok() && &buf == b"ping" {
                    let _ = stream.write_all(b"xxpongxx").await;
                }
            }
        });
        let mut check = check(1, 1);
        assert_eq!(probe(&check, addr, None, "c").await, Outcome::Healthy);
        check.checker = Checker::Tcp {
            send: Some(b"ping".to_vec()),
            receive: vec![b"pong".to_vec()],
        };
        assert_eq!(probe(&check, addr, None, "c").await, Outcome::Healthy);
        check.checker = Checker::Tcp {
            send: Some(b"ping".to_vec()),
            receive: vec![b"nope".to_vec()],
        };
        assert_eq!(probe(&check, addr, None, "c").await, Outcome::Failed);
        // Nothing listening.
        let closed = TcpListener::bind("127.0.0.1:0")
            .await
            .unwrap()
            .local_addr()
            .unwrap();
        assert_eq!(probe(&check, closed, None, "c").await, Outcome::Failed);
    }

    #[tokio::test]
    async fn a_failing_host_leaves_the_rotation_and_returns() {
        let status = Arc::new(AtomicU16::new(200));
        let good = http_server(Arc::new(AtomicU16::new(200))).await;
        let flaky = http_server(status.clone()).await;
        let mut config = ClusterConfig::new("c");
        config.health_checks.push(HealthCheck {
            interval: Duration::from_millis(20),
            interval_jitter: Duration::ZERO,
            interval_jitter_percent: 0,
            initial_jitter: Duration::ZERO,
            ..http_check()
        });
        config.panic_threshold = 0.0;
        let cluster = Cluster::new(config, vec![Host::new(good), Host::new(flaky)]);
        cluster.start().await;
        let routable = |cluster: &Cluster| -> Vec<SocketAddr> {
            cluster.routable_hosts().iter().map(|h| h.address).collect()
        };
        // Each step must happen within a deadline: a host that never leaves or never
        // returns fails the test instead of hanging it.
        let until = async |what: &str, done: &dyn Fn(&[SocketAddr]) -> bool| {
            let wait = async {
                while !done(&routable(&cluster)) {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            };
            tokio::time::timeout(Duration::from_secs(10), wait)
                .await
                .unwrap_or_else(|_| {
                    panic!("{what}: routable hosts stayed {:?}", routable(&cluster))
                });
        };
        until("both hosts healthy at first", &|hosts| hosts.len() == 2).await;
        status.store(500, Ordering::Relaxed);
        until("the failing host leaves", &|hosts| hosts == [good]).await;
        status.store(200, Ordering::Relaxed);
        until("the recovered host returns", &|hosts| hosts.len() == 2).await;
    }
}
