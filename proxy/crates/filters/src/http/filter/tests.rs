//! The filter chain in a connection manager serving over an in-memory connection:
//! decode order, local replies through the encoders, body buffering, per-route
//! `disabled`, the route seen on both sides, and `on_stream_complete`.

use std::sync::{Arc, Mutex};

use bytes::Bytes;
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::HttpConnectionManager as EnvoyHcm;
use http_body_util::{BodyExt as _, Full};
use hyper::header::{HeaderName, HeaderValue};
use hyper::{HeaderMap, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::json;

use super::chain::ConfiguredFilter;
use super::*;
use crate::http::connection_manager::{Downstream, serve};
use crate::http::{ConfigProvider, HttpConnectionManager, RequestConfig};
use shunt_config::{Diagnostics, JsonPath};
use shunt_core::access_log::Direction;
use shunt_tls::Secrets;
use shunt_upstream::Clusters;

#[derive(Default)]
struct Nothing {
    clusters: Clusters,
    secrets: Secrets,
}

impl RequestConfig for Nothing {
    fn route_config(&self, _: &str) -> Option<&Arc<crate::http::RouteConfig>> {
        None
    }
    fn clusters(&self) -> &Clusters {
        &self.clusters
    }
    fn secrets(&self) -> &Secrets {
        &self.secrets
    }
}

impl ConfigProvider for Nothing {
    fn request_config(&self) -> Arc<dyn RequestConfig> {
        Arc::new(Nothing::default())
    }
}

/// What the test filters saw, in order.
type Log = Arc<Mutex<Vec<String>>>;

/// Tags requests and responses with its name; answers `/deny/<name>` itself; reads the
/// body (uppercased into the reply) on `/body/<name>`.
#[derive(Debug)]
struct Tagger {
    name: &'static str,
    log: Log,
}

impl HttpFilterConfig for Tagger {
    fn create(&self) -> Box<dyn HttpFilter> {
        Box::new(TaggerStream {
            name: self.name,
            log: self.log.clone(),
        })
    }
}

struct TaggerStream {
    name: &'static str,
    log: Log,
}

impl HttpFilter for TaggerStream {
    fn decode_headers<'a>(
        &'a mut self,
        request: &'a mut RequestHeaders,
        _end_stream: bool,
        ctx: &'a mut StreamCtx,
    ) -> Flow<'a> {
        self.log
            .lock()
            .unwrap()
            .push(format!("{} decode {}", self.name, ctx.filter_name()));
        request.headers.append(
            HeaderName::from_static("x-decoded-by"),
            HeaderValue::from_static(self.name),
        );
        if request.path == format!("/deny/{}", self.name) {
            return FilterStatus::Reply(LocalReply::new(
                StatusCode::FORBIDDEN,
                format!("denied by {}", self.name),
                "test_denied",
            ))
            .into();
        }
        if request.path == format!("/body/{}", self.name) {
            return FilterStatus::StopIteration.into();
        }
        // A filter that waits (as an authorization call would).
        Flow::Pending(Box::pin(async {
            tokio::task::yield_now().await;
            FilterStatus::Continue
        }))
    }

    fn decode_data<'a>(
        &'a mut self,
        data: &'a mut Bytes,
        end_stream: bool,
        _ctx: &'a mut StreamCtx,
    ) -> Flow<'a> {
        self.log
            .lock()
            .unwrap()
            .push(format!("{} data {} {end_stream}", self.name, data.len()));
        let upper = data.to_ascii_uppercase();
        FilterStatus::Reply(LocalReply::new(StatusCode::OK, upper, "test_echo")).into()
    }

    fn encode_headers(
        &mut self,
        response: &mut ResponseHeaders,
        _end_stream: bool,
        ctx: &mut StreamCtx,
    ) -> FilterStatus {
        let route = ctx
            .route
            .as_ref()
            .map_or("none".to_owned(), |r| r.route().name.clone());
        self.log.lock().unwrap().push(format!(
            "{} encode {} route={route}",
            self.name,
            response.status.as_u16()
        ));
        response.headers.append(
            HeaderName::from_static("x-encoded-by"),
            HeaderValue::from_static(self.name),
        );
        FilterStatus::Continue
    }

    fn on_stream_complete(&mut self, info: &shunt_core::stream_info::StreamInfo) {
        self.log.lock().unwrap().push(format!(
            "{} complete {:?} {:?}",
            self.name, info.response_code, info.response_code_details
        ));
    }
}

fn hcm(log: &Log, second_disabled: bool) -> Arc<HttpConnectionManager> {
    let config: EnvoyHcm = shunt_config::message_from_json(json!({
        "stat_prefix": "f",
        "route_config": {"name": "rc", "virtual_hosts": [{"name": "v", "domains": ["*"], "routes": [
            {"name": "off", "match": {"prefix": "/off"},
             "direct_response": {"status": 200, "body": {"inline_string": "off"}},
             "typed_per_filter_config": {
                "a": {"@type": "type.googleapis.com/envoy.config.route.v3.FilterConfig", "disabled": true},
                "b": {"@type": "type.googleapis.com/envoy.config.route.v3.FilterConfig", "disabled": false}
             }},
            {"name": "any", "match": {"prefix": "/"},
             "direct_response": {"status": 200, "body": {"inline_string": "routed"}}}
        ]}]},
        "http_filters": [{"name": "router", "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}]
    }))
    .unwrap();
    let mut problems = Diagnostics::default();
    let stats = shunt_core::stats::Store::new();
    let mut hcm = crate::http::compile::compile(
        &config,
        &Default::default(),
        &stats,
        &JsonPath::new("hcm"),
        &mut problems,
    )
    .unwrap();
    assert!(problems.warnings.is_empty(), "{:?}", problems.warnings);
    for (name, disabled) in [("a", false), ("b", second_disabled)] {
        hcm.filters.filters.push(ConfiguredFilter {
            name: Arc::from(name),
            config: Arc::new(Tagger {
                name: if name == "a" { "a" } else { "b" },
                log: log.clone(),
            }),
            disabled,
        });
    }
    Arc::new(hcm)
}

/// Sends requests on one connection: (method, path, body) to (status, x-encoded-by,
/// body).
async fn exchange(
    hcm: Arc<HttpConnectionManager>,
    requests: &[(&str, &str)],
) -> Vec<(u16, Vec<String>, String)> {
    let (client_io, server_io) = tokio::io::duplex(64 * 1024);
    let local = "10.0.0.2:80".parse().unwrap();
    let remote = "10.0.0.1:1234".parse().unwrap();
    let downstream = Downstream {
        remote,
        local,
        original_dst: None,
        direction: Direction::Inbound,
        secure: false,
        own_ports: Arc::from(Vec::new()),
        connection: Arc::new(shunt_core::stream_info::Connection::new(local, remote)),
    };
    tokio::spawn(serve(
        hcm,
        Arc::new(Nothing::default()),
        server_io,
        downstream,
        std::future::pending(),
    ));
    let (mut client, connection) = hyper::client::conn::http1::handshake(TokioIo::new(client_io))
        .await
        .unwrap();
    tokio::spawn(connection);
    let mut out = Vec::new();
    for (path, body) in requests {
        let request = hyper::Request::post(*path)
            .header("host", "example.com")
            .body(Full::new(Bytes::from(body.to_string())))
            .unwrap();
        let response = client.send_request(request).await.unwrap();
        let status = response.status().as_u16();
        let encoded = response
            .headers()
            .get_all("x-encoded-by")
            .iter()
            .map(|v| v.to_str().unwrap().to_owned())
            .collect();
        let body = response.into_body().collect().await.unwrap().to_bytes();
        out.push((status, encoded, String::from_utf8_lossy(&body).into_owned()));
    }
    out
}

fn taken(log: &Log) -> Vec<String> {
    std::mem::take(&mut *log.lock().unwrap())
}

/// `on_stream_complete` runs when the stream's log slot goes: give it a moment.
async fn settled(log: &Log, lines: usize) -> Vec<String> {
    for _ in 0..1000 {
        if log.lock().unwrap().len() >= lines {
            break;
        }
        tokio::task::yield_now().await;
    }
    taken(log)
}

#[tokio::test]
async fn decoders_run_in_order_encoders_in_reverse_and_all_hear_the_end() {
    let log = Log::default();
    let out = exchange(hcm(&log, false), &[("/x", "")]).await;
    assert_eq!(out, [(200, vec!["b".into(), "a".into()], "routed".into())]);
    assert_eq!(
        settled(&log, 6).await,
        [
            "a decode a",
            "b decode b",
            "b encode 200 route=any",
            "a encode 200 route=any",
            "a complete Some(200) None",
            "b complete Some(200) None",
        ]
    );
}

#[tokio::test]
async fn a_local_reply_skips_later_decoders_and_the_router_but_not_the_encoders() {
    let log = Log::default();
    let out = exchange(hcm(&log, false), &[("/deny/a", "")]).await;
    assert_eq!(
        out,
        [(403, vec!["b".into(), "a".into()], "denied by a".into())]
    );
    assert_eq!(
        settled(&log, 5).await,
        [
            "a decode a",
            "b encode 403 route=any",
            "a encode 403 route=any",
            "a complete Some(403) Some(\"test_denied\")",
            "b complete Some(403) Some(\"test_denied\")",
        ]
    );
}

#[tokio::test]
async fn a_filter_that_stops_at_the_headers_gets_the_whole_body() {
    let log = Log::default();
    let body = "x".repeat(100_000);
    let out = exchange(hcm(&log, false), &[("/body/b", &body), ("/x", "")]).await;
    assert_eq!(out[0].0, 200);
    assert_eq!(out[0].2, "X".repeat(100_000));
    // The filter before it saw the body go by; it replied with its own copy.
    let lines = settled(&log, 4).await;
    assert_eq!(
        lines[..4],
        [
            "a decode a",
            "b decode b",
            "a data 100000 true",
            "b encode 200 route=any"
        ]
    );
    assert_eq!(out[1].0, 200, "the connection goes on");
}

#[tokio::test]
async fn routes_disable_and_enable_filters_by_name() {
    let log = Log::default();
    // "b" is disabled in the connection manager; route "off" disables "a" and
    // enables "b".
    let out = exchange(hcm(&log, true), &[("/off", ""), ("/x", "")]).await;
    assert_eq!(out[0], (200, vec!["b".into()], "off".into()));
    assert_eq!(out[1], (200, vec!["a".into()], "routed".into()));
    let lines = settled(&log, 6).await;
    assert!(lines.contains(&"b decode b".to_owned()), "{lines:?}");
    assert!(
        lines.contains(&"b encode 200 route=off".to_owned()),
        "{lines:?}"
    );
    assert!(
        lines.contains(&"a encode 200 route=any".to_owned()),
        "{lines:?}"
    );
    assert!(
        !lines
            .iter()
            .any(|l| l.starts_with("a") && l.contains("route=off")),
        "{lines:?}"
    );
}

#[test]
fn per_route_configs_are_most_specific_first() {
    let config: envoy_types::pb::envoy::config::route::v3::RouteConfiguration =
        shunt_config::message_from_json(json!({
            "name": "rc",
            "typed_per_filter_config": {"f": {"@type": "type.googleapis.com/envoy.config.route.v3.FilterConfig", "disabled": true}},
            "virtual_hosts": [{"name": "v", "domains": ["*"],
              "typed_per_filter_config": {"g": {"@type": "type.googleapis.com/envoy.config.route.v3.FilterConfig", "disabled": true}},
              "routes": [{"name": "r", "match": {"prefix": "/"}, "route": {"weighted_clusters": {"clusters": [
                {"name": "c", "weight": 1, "typed_per_filter_config": {"f": {"@type": "type.googleapis.com/envoy.config.route.v3.FilterConfig", "disabled": false}}}
              ]}},
              "typed_per_filter_config": {"g": {"@type": "type.googleapis.com/envoy.config.route.v3.FilterConfig", "disabled": false}}}]}]
        }))
        .unwrap();
    let mut problems = Diagnostics::default();
    let compiled = Arc::new(
        crate::http::route_config::compile(&config, &JsonPath::new("rc"), &mut problems).unwrap(),
    );
    let headers = HeaderMap::new();
    let view = crate::common::matcher::RequestView {
        method: "GET",
        authority: "h",
        path: "/",
        scheme: "http",
        headers: &headers,
    };
    let routed = Routed::find(&compiled, &view).unwrap();
    assert_eq!(routed.weighted, Some(0));
    // The weighted cluster beats the route configuration; the route beats the vhost.
    assert!(!routed.per_filter_config("f").unwrap().disabled);
    assert!(!routed.per_filter_config("g").unwrap().disabled);
    assert!(routed.per_filter_config("h").is_none());
}

/// Logs the request data it is shown.
#[derive(Debug)]
struct DataWatcher(Log);

impl HttpFilterConfig for DataWatcher {
    fn create(&self) -> Box<dyn HttpFilter> {
        Box::new(DataWatcherStream(self.0.clone()))
    }
}

struct DataWatcherStream(Log);

impl HttpFilter for DataWatcherStream {
    fn observes_body(&self) -> bool {
        true
    }

    fn on_request_data(&mut self, data: &[u8], _ctx: &mut StreamCtx) {
        self.0
            .lock()
            .unwrap()
            .push(String::from_utf8_lossy(data).into_owned());
    }
}

/// A stream's request body goes on flowing while the encoders have its filters (a
/// gRPC stream's next message during the response's headers): body-watching filters
/// still see every frame, in order.
#[test]
fn request_data_sent_while_the_encoders_run_is_still_observed() {
    use shunt_upstream::http_pool::BodyObserver as _;
    let log = Log::default();
    let filters = chain::FilterChain {
        filters: vec![ConfiguredFilter {
            name: Arc::from("watch"),
            config: Arc::new(DataWatcher(log.clone())),
            disabled: false,
        }],
    };
    let addr = "10.0.0.1:80".parse().unwrap();
    let connection = Arc::new(shunt_core::stream_info::Connection::new(addr, addr));
    let info = shunt_core::stream_info::StreamInfo::new(connection);
    let slot = crate::http::body::LogSlot::new();
    slot.set_chain(chain::ActiveChain::new(
        &filters,
        StreamCtx::new(info, None),
    ));
    slot.data(&Bytes::from_static(b"one"));
    let lent = slot.take_chain().expect("the chain is kept");
    slot.data(&Bytes::from_static(b"two"));
    slot.data(&Bytes::from_static(b"three"));
    assert_eq!(taken(&log), ["one"], "nothing reaches a lent chain");
    slot.set_chain(lent);
    slot.data(&Bytes::from_static(b"four"));
    assert_eq!(taken(&log), ["two", "three", "four"]);
    // What is held for a lent chain is bounded (by the buffer limit of HTTP filters).
    let lent = slot.take_chain().expect("the chain is kept");
    slot.data(&Bytes::from(vec![b'a'; chain::BUFFER_LIMIT]));
    slot.data(&Bytes::from_static(b"over"));
    slot.set_chain(lent);
    let lengths: Vec<usize> = taken(&log).iter().map(String::len).collect();
    assert_eq!(lengths, [chain::BUFFER_LIMIT]);
}
