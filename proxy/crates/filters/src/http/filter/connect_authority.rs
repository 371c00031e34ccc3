//! istio-proxy's `connect_authority` HTTP filter (`io.istio.http.connect_authority.Config`,
//! in the configs of istiods before 1.20): on a route whose per-filter config is
//! `enabled`, a request's authority (`host:port`, or the host with the config's
//! `port`) becomes `envoy.filters.listener.original_dst.local_ip` and the downstream
//! address `...remote_ip`, both shared with the upstream connection, so an internal
//! listener's `original_dst` restores the tunnel's destination. The filter's own
//! config only registers it; the per-route one turns it on.

use std::net::SocketAddr;
use std::sync::Arc;

use envoy_types::pb::google::protobuf::Any;

use super::factory::{CompileCtx, Factory};
use super::{Flow, HttpFilter, HttpFilterConfig, RequestHeaders, RouteSpecificConfig, StreamCtx};
use shunt_config::{Diagnostics, JsonPath};
use shunt_core::set_filter_state::{AddressObject, ORIGINAL_DST_LOCAL, ORIGINAL_DST_REMOTE, store};
use shunt_core::stream_info::{FilterStateEntry, LifeSpan};

pub const TYPE_NAME: &str = "io.istio.http.connect_authority.Config";

pub const FACTORY: Factory = Factory {
    type_name: TYPE_NAME,
    compile,
    per_route_types: &[TYPE_NAME],
    compile_per_route: Some(compile_route),
};

/// istio-proxy's config (config/protos/istio/connect.proto).
#[derive(Clone, PartialEq, prost::Message)]
struct Config {
    #[prost(bool, tag = "1")]
    enabled: bool,
    #[prost(uint32, tag = "2")]
    port: u32,
}

#[derive(Debug)]
struct ConnectAuthority;

#[derive(Debug)]
struct RouteConfig {
    enabled: bool,
    port: u16,
}

impl RouteSpecificConfig for RouteConfig {
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

fn decode(any: &Any, path: &JsonPath, problems: &mut Diagnostics) -> Option<Config> {
    match <Config as prost::Message>::decode(any.value.as_slice()) {
        Ok(config) => Some(config),
        Err(err) => {
            problems.error(path, format!("cannot decode {TYPE_NAME}: {err}"));
            None
        }
    }
}

fn compile(
    any: &Any,
    _ctx: &CompileCtx<'_>,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<Arc<dyn HttpFilterConfig>> {
    decode(any, path, problems)?;
    Some(Arc::new(ConnectAuthority))
}

fn compile_route(
    any: &Any,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<Arc<dyn RouteSpecificConfig>> {
    let config = decode(any, path, problems)?;
    let Ok(port) = u16::try_from(config.port) else {
        problems.error(path.field("port"), format!("{} is not a port", config.port));
        return None;
    };
    Some(Arc::new(RouteConfig {
        enabled: config.enabled,
        port,
    }))
}

impl HttpFilterConfig for ConnectAuthority {
    fn create(&self) -> Box<dyn HttpFilter> {
        Box::new(ConnectAuthority)
    }
}

/// The authority as an address: `ip:port`, or the host with `port` when it is set.
fn authority_address(authority: &str, port: u16) -> Option<SocketAddr> {
    if port == 0 {
        return authority.parse().ok();
    }
    let host = match authority.rsplit_once(':') {
        Some((host, p)) if p.parse::<u16>().is_ok() => host,
        _ => authority,
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    Some(SocketAddr::new(host.parse().ok()?, port))
}

fn shared(address: SocketAddr) -> FilterStateEntry {
    FilterStateEntry {
        value: Arc::new(AddressObject(address)),
        read_only: false,
        life_span: LifeSpan::FilterChain,
        shared_with_upstream: true,
        transitive: false,
    }
}

impl HttpFilter for ConnectAuthority {
    fn decode_headers<'a>(
        &'a mut self,
        request: &'a mut RequestHeaders,
        _end_stream: bool,
        ctx: &'a mut StreamCtx,
    ) -> Flow<'a> {
        let Some(config) = ctx.route_config::<RouteConfig>() else {
            return Flow::CONTINUE;
        };
        if !config.enabled {
            return Flow::CONTINUE;
        }
        let local = authority_address(&request.authority, config.port);
        let remote = ctx.info.connection.remote;
        if let Some(local) = local {
            store(
                &mut ctx.info.filter_state,
                ORIGINAL_DST_LOCAL,
                shared(local),
            );
        }
        store(
            &mut ctx.info.filter_state,
            ORIGINAL_DST_REMOTE,
            shared(remote),
        );
        Flow::CONTINUE
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_authority_is_an_address_with_its_port_or_the_configured_one() {
        assert_eq!(
            authority_address("10.1.2.3:8080", 0),
            Some("10.1.2.3:8080".parse().unwrap())
        );
        assert_eq!(
            authority_address("10.1.2.3:8080", 15008),
            Some("10.1.2.3:15008".parse().unwrap())
        );
        assert_eq!(
            authority_address("[fd00::1]:80", 0),
            Some("[fd00::1]:80".parse().unwrap())
        );
        assert_eq!(authority_address("svc.ns:80", 0), None);
        assert_eq!(authority_address("10.1.2.3", 0), None);
    }
}
