//! The HTTP side: accept loops for the admin address and the health ports, hyper
//! connections (HTTP/1.1 and HTTP/2, as Envoy's admin), and a graceful stop that lets
//! answers in flight (`/quitquitquit`'s own) finish.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::header::{CACHE_CONTROL, CONTENT_TYPE, HeaderValue, X_CONTENT_TYPE_OPTIONS};
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tokio::sync::watch;

use super::Shared;
use super::handlers::{self, Reply};
use shunt_config::health_ports::{Answer, HealthListener};

/// How long connections still open at a stop get to finish.
const STOP_GRACE: Duration = Duration::from_secs(5);

/// Answers one request: method, path, query.
type Route = Arc<dyn Fn(&Method, &str, &str) -> Reply + Send + Sync>;

/// Serves the admin address and the health ports until `stop` becomes true.
pub(super) async fn serve(
    shared: Arc<Shared>,
    admin: Option<std::net::TcpListener>,
    health: Vec<(HealthListener, std::net::TcpListener)>,
    stop: watch::Receiver<bool>,
) {
    let mut loops = tokio::task::JoinSet::new();
    if let Some(listener) = admin {
        let shared = shared.clone();
        let route: Route =
            Arc::new(move |method, path, query| handlers::handle(&shared, method, path, query));
        spawn_loop(&mut loops, listener, "admin", route, stop.clone());
    }
    for (health, listener) in health {
        let shared = shared.clone();
        let name = health.name.clone();
        let route: Route = Arc::new(move |method, path, query| {
            match health.answer(path) {
                // What the route's upstream, the admin API, would answer.
                Some(Answer::PrometheusStats) => handlers::handle(&shared, method, path, query),
                // What pilot-agent's /healthz/ready would answer.
                Some(Answer::Readiness) if shared.is_ready_for_traffic() => Reply::ok(""),
                Some(Answer::Readiness) => Reply::text(StatusCode::SERVICE_UNAVAILABLE, ""),
                // Envoy's router without a matching route.
                None => Reply::text(StatusCode::NOT_FOUND, ""),
            }
        });
        spawn_loop(&mut loops, listener, &name, route, stop.clone());
    }
    while loops.join_next().await.is_some() {}
}

fn spawn_loop(
    loops: &mut tokio::task::JoinSet<()>,
    listener: std::net::TcpListener,
    name: &str,
    route: Route,
    stop: watch::Receiver<bool>,
) {
    let name = name.to_owned();
    match TcpListener::from_std(listener) {
        Ok(listener) => {
            loops.spawn(accept_loop(listener, name, route, stop));
        }
        Err(err) => tracing::error!(listener = %name, %err, "admin: cannot register listener"),
    }
}

async fn accept_loop(
    listener: TcpListener,
    name: String,
    route: Route,
    mut stop: watch::Receiver<bool>,
) {
    let local: Option<SocketAddr> = listener.local_addr().ok();
    tracing::info!(listener = %name, address = ?local, "admin: listening");
    let builder = auto::Builder::new(TokioExecutor::new());
    let graceful = GracefulShutdown::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    let route = route.clone();
                    let service = service_fn(move |request: Request<Incoming>| {
                        let uri = request.uri();
                        let reply = route(request.method(), uri.path(), uri.query().unwrap_or(""));
                        std::future::ready(Ok::<_, Infallible>(response(reply)))
                    });
                    let connection = builder
                        .serve_connection(TokioIo::new(stream), service)
                        .into_owned();
                    let connection = graceful.watch(connection);
                    tokio::spawn(async move {
                        if let Err(err) = connection.await {
                            tracing::debug!(%err, "admin: connection ended with an error");
                        }
                    });
                }
                Err(err) if err.kind() == std::io::ErrorKind::ConnectionAborted => {}
                Err(err) => {
                    tracing::warn!(listener = %name, %err, "admin: accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            () = stopped(&mut stop) => break,
        }
    }
    drop(listener);
    if tokio::time::timeout(STOP_GRACE, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!(listener = %name, "admin: connections still open at stop were closed");
    }
}

/// Resolves once a stop is asked for, or the handle is gone.
async fn stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|stop| *stop).await;
}

fn response(reply: Reply) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(reply.body)));
    *response.status_mut() = reply.status;
    let headers = response.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static(reply.content_type));
    headers.insert(
        CACHE_CONTROL,
        HeaderValue::from_static("no-cache, max-age=0"),
    );
    headers.insert(X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    response
}
