//! HTTP/1.1 upgrades (WebSocket and any `upgrade_configs` type): the request goes to the
//! upstream on a connection of its own with its `Upgrade` and `Connection` headers, and
//! once the upstream answers 101 the two connections are joined and bytes copied both
//! ways until either side closes. Anything else the upstream answers is passed back as
//! a plain response.

use std::sync::Arc;

use hyper::Response;
use hyper::client::conn::http1;
use hyper::header::{self, HeaderMap, HeaderValue};
use hyper::upgrade::OnUpgrade;
use hyper_util::rt::TokioIo;

use super::body::{LogSlot, ResponseBody};
use super::router::{self, Head, LocalReply, Upstream};
use shunt_core::access_log::{Entry, ResponseFlag};
use shunt_upstream::LbContext;
use shunt_upstream::http_pool::RequestBody;

/// The upgrade a request asks for (`Upgrade`, lowercase), if it asks for one the HTTP/1.1
/// way (`Connection: upgrade`).
pub fn requested(headers: &HeaderMap) -> Option<String> {
    let connection_upgrade = shunt_upstream::http1::tokens(headers, header::CONNECTION)
        .any(|token| token.eq_ignore_ascii_case(b"upgrade"));
    let upgrade = headers.get(header::UPGRADE)?.to_str().ok()?;
    connection_upgrade.then(|| upgrade.trim().to_ascii_lowercase())
}

/// Envoy's HTTP/1 codec ignores a request to upgrade to HTTP/2 (`Upgrade: h2c`, RFC
/// 7540 3.2), whatever `upgrade_configs` says: it removes `Upgrade`, `HTTP2-Settings`
/// and their `Connection` tokens, and the request is served over HTTP/1.1 as if it had
/// not asked.
pub fn ignore_h2c(headers: &mut HeaderMap) {
    if requested(headers).as_deref() != Some("h2c") {
        return;
    }
    headers.remove(header::UPGRADE);
    headers.remove(super::headers::HTTP2_SETTINGS);
    let kept: Vec<String> = shunt_upstream::http1::tokens(headers, header::CONNECTION)
        .filter(|t| {
            !t.eq_ignore_ascii_case(b"upgrade") && !t.eq_ignore_ascii_case(b"http2-settings")
        })
        .filter_map(|t| std::str::from_utf8(t).ok())
        .map(str::to_owned)
        .collect();
    headers.remove(header::CONNECTION);
    if let Ok(value) = HeaderValue::from_str(&kept.join(", "))
        && !kept.is_empty()
    {
        headers.insert(header::CONNECTION, value);
    }
}

/// Forwards an upgrade request and, on 101, joins the connections in a task of its own
/// that holds the request's access log until the tunnel closes.
pub async fn forward(
    upstream: &Upstream<'_>,
    mut head: Head,
    body: RequestBody,
    downstream: OnUpgrade,
    log: Arc<LogSlot>,
    stats: &super::config::HttpStats,
    entry: &mut Entry,
) -> Result<Response<ResponseBody>, LocalReply> {
    let cluster = upstream.cluster.clone();
    let Some(host) = cluster.choose_host(
        &LbContext {
            hash: upstream.hash,
            tried: &[],
        },
        Some(upstream.destination),
    ) else {
        return Err(LocalReply::new(
            hyper::StatusCode::SERVICE_UNAVAILABLE,
            "no healthy upstream",
            Some(ResponseFlag::NoHealthyUpstream),
        ));
    };
    entry.upstream_host = Some(host.address);
    let Some(slot) = cluster.circuit_breaker.try_acquire_owned() else {
        return Err(LocalReply::new(
            hyper::StatusCode::SERVICE_UNAVAILABLE,
            "upstream connect error or disconnect/reset before headers. reset reason: overflow",
            Some(ResponseFlag::UpstreamOverflow),
        ));
    };
    let connect_failure = || {
        LocalReply::new(
            hyper::StatusCode::SERVICE_UNAVAILABLE,
            "upstream connect error or disconnect/reset before headers. reset reason: connection failure",
            Some(ResponseFlag::UpstreamConnectionFailure),
        )
    };
    let (io, guard, _) = shunt_upstream::http_pool::connect_upstream(
        &cluster,
        &host,
        upstream.secrets,
        upstream.alpn.as_deref(),
        Some("http/1.1"),
    )
    .await
    .map_err(|_| connect_failure())?;
    let (mut sender, connection) = http1::handshake(TokioIo::new(io))
        .await
        .map_err(|_| connect_failure())?;
    tokio::spawn(async move {
        if let Err(err) = connection.with_upgrades().await {
            tracing::debug!(%err, "upgraded upstream connection ended with an error");
        }
    });
    // The one hop-by-hop pair that must reach the upstream.
    let upgrade = head.headers.get(header::UPGRADE).cloned();
    router::strip_hop_by_hop(&mut head.headers);
    if let Some(upgrade) = upgrade {
        head.headers.insert(header::UPGRADE, upgrade);
        head.headers
            .insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    }
    cluster.stats.upstream_rq_total.inc();
    let mut response = sender
        .send_request(head.request(false, body, true))
        .await
        .map_err(|err| {
            tracing::debug!(%err, "upstream reset an upgrade request");
            if err.is_parse() {
                return LocalReply::upstream_protocol_error();
            }
            LocalReply::new(
                hyper::StatusCode::SERVICE_UNAVAILABLE,
                "upstream connect error or disconnect/reset before headers. reset reason: connection termination",
                Some(ResponseFlag::UpstreamConnectionTermination),
            )
        })?;
    cluster.stats.charge(response.status().as_u16());
    if response.status() != hyper::StatusCode::SWITCHING_PROTOCOLS {
        let (mut parts, incoming) = response.into_parts();
        router::strip_hop_by_hop(&mut parts.headers);
        return Ok(Response::from_parts(
            parts,
            ResponseBody::upstream(incoming, None),
        ));
    }
    let upstream_side = hyper::upgrade::on(&mut response);
    let tunnel_log = log.clone();
    // `downstream_cx_upgrades_*`, as Envoy counts the upgrade once the 101 is the answer.
    let upgraded = stats.upgrade();
    tokio::spawn(async move {
        let _held = (slot, guard, tunnel_log.clone(), upgraded);
        let (Ok(down), Ok(up)) = (downstream.await, upstream_side.await) else {
            tracing::debug!("an upgrade did not complete");
            return;
        };
        let (mut down, mut up) = (TokioIo::new(down), TokioIo::new(up));
        match tokio::io::copy_bidirectional(&mut down, &mut up).await {
            Ok((received, sent)) => tunnel_log.add(received, sent),
            Err(err) => tracing::debug!(%err, "upgraded connection ended with an error"),
        }
    });
    // The 101 goes back with its Upgrade and Connection headers.
    let (parts, _) = response.into_parts();
    Ok(Response::from_parts(
        parts,
        ResponseBody::full(bytes::Bytes::new()),
    ))
}
