//! pilot-agent's status server: 15020 answers `/healthz/ready` (the proxy's readiness),
//! the merged Prometheus endpoint ([`prometheus`]), the kubelet's rewritten app probes
//! ([`probes`]), `/quitquitquit` and `/drain`; 15021 answers `/healthz/ready` alone
//! when the proxy's bootstrap does not serve that port itself (Istio's does, routing to
//! 15020).
//!
//! Readiness is asked of the proxy's admin API (`/ready`: LIVE once its first config is
//! applied, xDS warmed and listeners bound), so it reads the same for the in-process
//! proxy and a supervised Envoy. As in pilot-agent, the first 200 is remembered (a
//! ready proxy stays ready for the kubelet) until termination starts, which makes it
//! 503 for good.

mod client;
pub mod probes;
pub mod prometheus;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::header::{CONTENT_TYPE, HeaderValue};
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use tokio::net::TcpListener;
use tokio::sync::Notify;

pub use client::{Answer, Call};

/// Prometheus' text format, what the merged endpoint answers in.
const PROMETHEUS_TEXT: &str = "text/plain; version=0.0.4; charset=utf-8";
/// How long one readiness question to the admin API may take.
const ADMIN_TIMEOUT: Duration = Duration::from_secs(2);
/// A scrape without `X-Prometheus-Scrape-Timeout-Seconds`.
const SCRAPE_TIMEOUT: Duration = Duration::from_secs(10);

/// Everything the status server answers from.
pub struct StatusServer {
    /// The proxy's admin API.
    pub admin: SocketAddr,
    pub probers: probes::AppProbers,
    pub app_scrape: Option<prometheus::AppScrape>,
    pub status_port: u16,
    pub metrics: prometheus::AgentMetrics,
    pub lifecycle: Lifecycle,
    ever_ready: AtomicBool,
    /// Why the control plane may keep the proxy unready (the agent's xDS proxy), added
    /// to a 503's reason.
    pub control_plane: std::sync::OnceLock<Diagnosis>,
}

/// A source of "why not ready" beyond the proxy's own answer.
pub type Diagnosis = Arc<dyn Fn() -> Option<String> + Send + Sync>;

/// What the status server tells the agent's lifecycle, and what it reads back.
#[derive(Debug, Default)]
pub struct Lifecycle {
    /// Shared with the in-process proxy, whose 15021 answers this readiness.
    terminating: Arc<AtomicBool>,
    /// `/quitquitquit`: exit now, without a drain.
    pub quit: Notify,
    /// `/drain`: stop taking inbound connections, keep running.
    pub drain: Notify,
}

impl Lifecycle {
    /// Termination started: readiness is 503 from now on.
    pub fn set_terminating(&self) {
        self.terminating.store(true, Ordering::SeqCst);
    }

    pub fn is_terminating(&self) -> bool {
        self.terminating.load(Ordering::SeqCst)
    }

    /// The flag [`Self::set_terminating`] sets, for a proxy that answers Istio's 15021
    /// itself.
    pub fn terminating_flag(&self) -> Arc<AtomicBool> {
        self.terminating.clone()
    }
}

impl StatusServer {
    pub fn new(
        admin: SocketAddr,
        probers: probes::AppProbers,
        app_scrape: Option<prometheus::AppScrape>,
        status_port: u16,
    ) -> Self {
        let metrics = prometheus::AgentMetrics::default();
        let _ = metrics.start.set(std::time::SystemTime::now());
        StatusServer {
            admin,
            probers,
            app_scrape,
            status_port,
            metrics,
            lifecycle: Lifecycle::default(),
            ever_ready: AtomicBool::new(false),
            control_plane: std::sync::OnceLock::new(),
        }
    }

    /// Serves the status port (everything) and, if given, the readiness port
    /// (`/healthz/ready` only) until the runtime ends.
    pub async fn serve(
        self: Arc<Self>,
        status: std::net::TcpListener,
        readiness: Option<std::net::TcpListener>,
    ) -> anyhow::Result<()> {
        let mut loops = tokio::task::JoinSet::new();
        loops.spawn(accept_loop(
            TcpListener::from_std(status)?,
            self.clone(),
            true,
        ));
        if let Some(readiness) = readiness {
            loops.spawn(accept_loop(TcpListener::from_std(readiness)?, self, false));
        }
        while loops.join_next().await.is_some() {}
        Ok(())
    }

    /// The proxy's readiness: `Err` says why not.
    pub async fn check_ready(&self) -> Result<(), String> {
        if self.lifecycle.is_terminating() {
            return Err("server is terminated".into());
        }
        if self.ever_ready.load(Ordering::Relaxed) {
            return Ok(());
        }
        match Call::get(self.admin, "/ready", ADMIN_TIMEOUT).send().await {
            Ok(answer) if answer.status == StatusCode::OK => {
                self.ever_ready.store(true, Ordering::Relaxed);
                tracing::info!("the proxy is ready");
                Ok(())
            }
            Ok(answer) => {
                let mut why = format!(
                    "the proxy is not ready: {}",
                    String::from_utf8_lossy(&answer.body).trim()
                );
                if let Some(more) = self.control_plane.get().and_then(|d| d()) {
                    why = format!("{why}: {more}");
                }
                Err(why)
            }
            Err(err) => Err(format!("the proxy's admin API does not answer: {err:#}")),
        }
    }

    async fn handle(
        &self,
        request: Request<Incoming>,
        peer: SocketAddr,
        status_port: bool,
    ) -> Reply {
        let path = request.uri().path().to_owned();
        if path == "/healthz/ready" {
            return match self.check_ready().await {
                Ok(()) => reply(StatusCode::OK, ""),
                Err(why) => {
                    tracing::debug!("/healthz/ready: {why}");
                    reply(StatusCode::SERVICE_UNAVAILABLE, why)
                }
            };
        }
        if !status_port {
            return reply(StatusCode::NOT_FOUND, "");
        }
        match path.as_str() {
            "/stats/prometheus" | "/metrics" => self.merged_metrics(&request).await,
            "/quitquitquit" | "/drain" => {
                // `to_canonical`: on the dual-stack socket 127.0.0.1 is ::ffff:127.0.0.1.
                if !peer.ip().to_canonical().is_loopback() {
                    return reply(
                        StatusCode::FORBIDDEN,
                        "Only requests from localhost are allowed\n",
                    );
                }
                if request.method() != Method::POST {
                    return reply(StatusCode::METHOD_NOT_ALLOWED, "Method Not Allowed\n");
                }
                if path == "/quitquitquit" {
                    tracing::info!("/quitquitquit: exiting");
                    self.lifecycle.quit.notify_one();
                } else {
                    tracing::info!("/drain: draining inbound listeners");
                    self.lifecycle.drain.notify_one();
                }
                reply(StatusCode::OK, "OK")
            }
            _ if path.starts_with("/app-health/") || path.starts_with("/app-lifecycle/") => {
                let host = request
                    .headers()
                    .get(hyper::header::HOST)
                    .and_then(|h| h.to_str().ok());
                let (status, body) = self
                    .probers
                    .probe(&path, host, request.headers(), self.status_port)
                    .await;
                Response::builder()
                    .status(status)
                    .body(Full::new(body))
                    .expect("a valid status")
            }
            _ => reply(StatusCode::NOT_FOUND, "404 page not found\n"),
        }
    }

    /// Agent, then proxy, then app metrics; a source that fails is left out.
    async fn merged_metrics(&self, request: &Request<Incoming>) -> Reply {
        self.metrics.scrapes.fetch_add(1, Ordering::Relaxed);
        let timeout = request
            .headers()
            .get("x-prometheus-scrape-timeout-seconds")
            .and_then(|t| t.to_str().ok()?.parse::<f64>().ok())
            .and_then(|s| Duration::try_from_secs_f64(s).ok())
            .unwrap_or(SCRAPE_TIMEOUT);
        let query = request
            .uri()
            .query()
            .map(|q| format!("?{q}"))
            .unwrap_or_default();
        let proxy_path = format!("/stats/prometheus{query}");
        let proxy = async { Call::get(self.admin, &proxy_path, timeout).send().await };
        let app = async {
            let mut bodies = Vec::new();
            for (port, path) in self.app_scrape.iter().flat_map(|s| &s.targets) {
                let to = SocketAddr::from(([127, 0, 0, 1], *port));
                let mut call = Call::get(to, path, timeout);
                call.host = Some("localhost");
                call.headers.insert(
                    hyper::header::ACCEPT,
                    HeaderValue::from_static("text/plain"),
                );
                bodies.push(call.send().await);
            }
            bodies
        };
        let (proxy, app) = tokio::join!(proxy, app);
        let mut out = self.metrics.render().into_bytes();
        match proxy {
            Ok(answer) if answer.status == StatusCode::OK => out.extend_from_slice(&answer.body),
            Ok(answer) => {
                self.metrics
                    .envoy_scrape_failures
                    .fetch_add(1, Ordering::Relaxed);
                tracing::warn!(status = %answer.status, "scraping the proxy's metrics failed");
            }
            Err(err) => {
                self.metrics
                    .envoy_scrape_failures
                    .fetch_add(1, Ordering::Relaxed);
                tracing::warn!("scraping the proxy's metrics failed: {err:#}");
            }
        }
        for body in app {
            match body {
                Ok(answer) if answer.status == StatusCode::OK => {
                    if !out.ends_with(b"\n") && !out.is_empty() {
                        out.push(b'\n');
                    }
                    out.extend_from_slice(strip_openmetrics_eof(&answer.body));
                }
                Ok(answer) => {
                    self.metrics
                        .app_scrape_failures
                        .fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(status = %answer.status, "scraping the app's metrics failed");
                }
                Err(err) => {
                    self.metrics
                        .app_scrape_failures
                        .fetch_add(1, Ordering::Relaxed);
                    tracing::warn!("scraping the app's metrics failed: {err:#}");
                }
            }
        }
        let mut response = Response::new(Full::new(Bytes::from(out)));
        response
            .headers_mut()
            .insert(CONTENT_TYPE, HeaderValue::from_static(PROMETHEUS_TEXT));
        response
    }
}

/// OpenMetrics ends with `# EOF`, which must not appear mid-output.
fn strip_openmetrics_eof(body: &[u8]) -> &[u8] {
    let end = body
        .iter()
        .rposition(|b| !b" \t\r\n".contains(b))
        .map_or(0, |i| i + 1);
    match body[..end].strip_suffix(b"# EOF") {
        Some(rest) => rest,
        None => body,
    }
}

type Reply = Response<Full<Bytes>>;

fn reply(status: StatusCode, body: impl Into<Bytes>) -> Reply {
    let mut response = Response::new(Full::new(body.into()));
    *response.status_mut() = status;
    response.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    response
}

async fn accept_loop(listener: TcpListener, server: Arc<StatusServer>, status_port: bool) {
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(err) => {
                tracing::warn!(%err, "status server: accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let server = server.clone();
        tokio::spawn(async move {
            let service = service_fn(move |request| {
                let server = server.clone();
                async move { Ok::<_, Infallible>(server.handle(request, peer, status_port).await) }
            });
            let _ = auto::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn openmetrics_eof_is_cut_from_the_app_section() {
        assert_eq!(strip_openmetrics_eof(b"a 1\n# EOF\n"), b"a 1\n");
        assert_eq!(strip_openmetrics_eof(b"a 1\n"), b"a 1\n");
    }
}
