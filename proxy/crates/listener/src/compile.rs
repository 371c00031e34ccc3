//! Compiling `static_resources.listeners`: addresses, listener filters, filter chains
//! (their matches and network filters), the default chain and listener access logs.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use envoy_types::pb::envoy::config::core::v3::TrafficDirection;
use envoy_types::pb::envoy::config::listener::v3::{
    FilterChain as EnvoyFilterChain, FilterChainMatch as EnvoyMatch, Listener as EnvoyListener,
    filter, filter_chain_match::ConnectionSourceType, listener::ListenerSpecifier, listener_filter,
};
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::HttpConnectionManager as EnvoyHcm;
use envoy_types::pb::envoy::extensions::filters::network::tcp_proxy::v3::{
    TcpProxy as EnvoyTcpProxy, tcp_proxy::ClusterSpecifier as EnvoySpecifier,
};

use super::chain_matcher::ChainMatcher;
use super::config::{
    DEFAULT_LISTENER_FILTERS_TIMEOUT, FilterChain, Listener, ListenerFilters, NetworkFilter,
};
use super::filter_chain::{FilterChainMatch, FilterChains, SourceType};
use shunt_config::convert::{self, decode, duration_or};
use shunt_config::{Diagnostics, JsonPath};
use shunt_core::access_log::Direction;
use shunt_core::stats::{self, Counter, Gauge, Histogram, Store};
use shunt_filters::tcp::compile as tcp_proxy;
use shunt_upstream::Clusters;

const ORIGINAL_DST: &str = "envoy.extensions.filters.listener.original_dst.v3.OriginalDst";
const TLS_INSPECTOR: &str = "envoy.extensions.filters.listener.tls_inspector.v3.TlsInspector";
const HTTP_INSPECTOR: &str = "envoy.extensions.filters.listener.http_inspector.v3.HttpInspector";
/// Istio's listener filter for internal listeners, before Envoy's `original_dst` did
/// the same job.
const SET_INTERNAL_DST_ADDRESS: &str = "istio.set_internal_dst_address.v1.Config";
const TCP_PROXY: &str = "envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy";
const HCM: &str =
    "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager";

/// The listener filters compiled here: config validation's list of them.
pub const LISTENER_FILTERS: &[&str] = &[
    ORIGINAL_DST,
    TLS_INSPECTOR,
    HTTP_INSPECTOR,
    SET_INTERNAL_DST_ADDRESS,
];

/// The terminal network filters compiled here (the others are in
/// `shunt_filters::network::registry`): config validation's list of them.
pub const TERMINAL_FILTERS: &[&str] = &[TCP_PROXY, HCM];

/// A listener's `listener.<stat_prefix or address>.*` stats.
#[derive(Debug, Clone, Default)]
pub struct ListenerStats {
    pub downstream_cx_total: Counter,
    pub downstream_cx_active: Gauge,
    /// Connections closed because no filter chain matched.
    pub no_filter_chain_match: Counter,
    /// How long connections lasted, from the hand-over to the filter chain to the end.
    pub downstream_cx_length_ms: Histogram,
    /// `ssl.handshake` / `ssl.connection_error` of chains terminating TLS.
    pub ssl: shunt_tls::SslStats,
    /// Holds `listener.<prefix>.*` in the store while the listener is in use.
    pub scope: Option<std::sync::Arc<stats::ScopeGuard>>,
}

impl ListenerStats {
    /// The stats of `listener`: named by its `stat_prefix`, else by its configured
    /// address as Envoy writes it (`0.0.0.0_15001`; port 0 stays 0, as in Envoy).
    pub fn new(store: &Store, listener: &EnvoyListener, address: Option<SocketAddr>) -> Self {
        let Some(prefix) = Self::prefix(listener, address) else {
            return ListenerStats::default();
        };
        let name = |stat: &str| format!("listener.{prefix}.{stat}");
        ListenerStats {
            downstream_cx_total: store.counter(&name("downstream_cx_total")),
            downstream_cx_active: store.gauge(&name("downstream_cx_active")),
            no_filter_chain_match: store.counter(&name("no_filter_chain_match")),
            downstream_cx_length_ms: store.histogram(&name("downstream_cx_length_ms")),
            ssl: shunt_tls::SslStats::new(store, &format!("listener.{prefix}")),
            scope: Some(std::sync::Arc::new(
                store.scope(&format!("listener.{prefix}.")),
            )),
        }
    }

    /// What the listener's stat names start with after `listener.`: its `stat_prefix`,
    /// else its address (`0.0.0.0_15001`); `None` without either.
    pub fn prefix(listener: &EnvoyListener, address: Option<SocketAddr>) -> Option<String> {
        if !listener.stat_prefix.is_empty() {
            Some(listener.stat_prefix.clone())
        } else if let Some(ListenerSpecifier::InternalListener(_)) = &listener.listener_specifier {
            // Envoy names an internal listener's stats by its address, `envoy://name`.
            Some(format!("envoy_internal_{}", listener.name))
        } else {
            address.map(|address| stats::listener_stat_prefix(&address))
        }
    }

    /// Counts a connection the listener serves, active until the guard drops.
    pub fn connection(&self) -> ActiveDownstream {
        self.downstream_cx_total.inc();
        self.downstream_cx_active.inc();
        ActiveDownstream {
            active: self.downstream_cx_active.clone(),
            length: self.downstream_cx_length_ms.clone(),
            since: Instant::now(),
        }
    }
}

/// One downstream connection counted in its listener's `downstream_cx_active`.
#[derive(Debug)]
pub struct ActiveDownstream {
    active: Gauge,
    length: Histogram,
    since: Instant,
}

impl Drop for ActiveDownstream {
    fn drop(&mut self) {
        self.active.dec();
        self.length
            .record(self.since.elapsed().as_secs_f64() * 1000.0);
    }
}

/// A listener to compile: its index in `static_resources.listeners` (`None`: from LDS)
/// and its config.
pub type Source<'a> = (Option<usize>, &'a EnvoyListener);

/// A listener's JSON path in messages, written only when needed: an update keeps most
/// listeners as they are and names none of them.
fn path_of((index, listener): Source<'_>) -> JsonPath {
    JsonPath::resource("listeners", "Listener", index, &listener.name)
}

/// The previous snapshot's listener `name` with its stats, if compiled from the config
/// with that digest: an update keeps it as it is.
pub type KeptListener<'a> = dyn Fn(&str, u64) -> Option<(Arc<Listener>, ListenerStats)> + 'a;

/// Compiles every listener but those named in `skip` (served elsewhere: the admin API's
/// health ports), each at its JSON path. Returns the listeners, their stats and config
/// digests, in the same order. A listener whose config is the same as in `previous`
/// keeps its compiled `Arc` and stats: an update does not touch its connections.
pub fn compile_all(
    listeners: &[Source<'_>],
    skip: &HashSet<String>,
    clusters: &Clusters,
    kept: &KeptListener<'_>,
    stats: &Store,
    node: &Arc<shunt_core::peer::LocalNode>,
    problems: &mut Diagnostics,
) -> (Vec<Arc<Listener>>, Vec<ListenerStats>, Vec<u64>) {
    let mut compiled: Vec<Arc<Listener>> = Vec::new();
    let mut listener_stats = Vec::new();
    let mut digests = Vec::new();
    let mut names = HashSet::new();
    let mut addresses: HashMap<SocketAddr, Arc<str>> = HashMap::new();
    for &source in listeners {
        let listener = source.1;
        let name = if listener.name.is_empty() {
            path_of(source).into()
        } else {
            listener.name.clone()
        };
        if !names.insert(name.clone()) {
            problems.error(
                path_of(source).field("name"),
                format!("a second listener named {name:?}"),
            );
            continue;
        }
        if skip.contains(&name) {
            continue;
        }
        let digest = shunt_config::digest(listener);
        let (compiled_listener, its_stats) = match kept(&name, digest) {
            Some(kept) => kept,
            None => {
                let path = path_of(source);
                let Some(fresh) = compile(listener, name, clusters, stats, node, &path, problems)
                else {
                    continue;
                };
                let its_stats =
                    ListenerStats::new(stats, listener, fresh.addresses.first().copied());
                (Arc::new(fresh), its_stats)
            }
        };
        for addr in &compiled_listener.addresses {
            // Port 0 asks the kernel for a port: such listeners cannot clash.
            if addr.port() == 0 {
                continue;
            }
            if let Some(other) = addresses.insert(*addr, compiled_listener.name.clone()) {
                problems.error(
                    path_of(source).field("address"),
                    format!("{addr} is already the address of listener {other:?}"),
                );
            }
        }
        listener_stats.push(its_stats);
        compiled.push(compiled_listener);
        digests.push(digest);
    }
    (compiled, listener_stats, digests)
}

/// The clusters the `tcp_proxy` filters of the listeners (but those in `skip`) route
/// to, each with the first listener that routes there.
pub fn routed_clusters(
    listeners: &[Source<'_>],
    skip: &HashSet<String>,
) -> HashMap<String, String> {
    let mut routed = HashMap::new();
    for (_, listener) in listeners.iter().filter(|(_, l)| !skip.contains(&l.name)) {
        let filters = listener
            .filter_chains
            .iter()
            .chain(&listener.default_filter_chain)
            .flat_map(|chain| &chain.filters);
        for filter in filters {
            let Some(filter::ConfigType::TypedConfig(any)) = &filter.config_type else {
                continue;
            };
            if convert::type_name(any) != TCP_PROXY {
                continue;
            }
            let Ok(proxy) = <EnvoyTcpProxy as prost::Message>::decode(any.value.as_slice()) else {
                continue;
            };
            let names: Vec<String> = match proxy.cluster_specifier {
                Some(EnvoySpecifier::Cluster(name)) => vec![name],
                Some(EnvoySpecifier::WeightedClusters(weighted)) => {
                    weighted.clusters.into_iter().map(|c| c.name).collect()
                }
                None => Vec::new(),
            };
            for name in names {
                routed.entry(name).or_insert_with(|| listener.name.clone());
            }
        }
    }
    routed
}

/// Compiles one listener. The stages follow the `Listener` message: addresses, listener
/// filters, filter chains (with their matcher), direction and access logs.
fn compile(
    listener: &EnvoyListener,
    name: String,
    clusters: &Clusters,
    stats: &Store,
    node: &Arc<shunt_core::peer::LocalNode>,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<Listener> {
    let errors_before = problems.errors.len();
    let env = shunt_filters::http::compile::Env {
        node: node.clone(),
        inbound: match TrafficDirection::try_from(listener.traffic_direction) {
            Ok(TrafficDirection::Inbound) => Some(true),
            Ok(TrafficDirection::Outbound) => Some(false),
            _ => None,
        },
    };
    if listener.api_listener.is_some() {
        problems.error(
            path.field("api_listener"),
            "API listeners are not implemented yet",
        );
        return None;
    }
    let internal = matches!(
        &listener.listener_specifier,
        Some(ListenerSpecifier::InternalListener(_))
    );
    let addresses = addresses(listener, internal, path, problems);
    let listener_prefix = ListenerStats::prefix(listener, addresses.first().copied());
    let filters = listener_filters(listener, internal, path, problems);
    let chain_env = (stats, listener_prefix.as_deref(), &env);
    let filter_chains = filter_chains(listener, internal, clusters, chain_env, path, problems);
    let uses_tls_facts = listener.filter_chains.iter().any(|c| {
        c.filter_chain_match
            .as_ref()
            .is_some_and(|m| !m.server_names.is_empty() || m.transport_protocol == "tls")
    });
    if uses_tls_facts && !filters.tls_inspector {
        problems.warning(
            path.field("listener_filters"),
            "chains match on server_names or transport_protocol tls, but there is no tls_inspector: they never match",
        );
    }

    let direction = match TrafficDirection::try_from(listener.traffic_direction) {
        Ok(TrafficDirection::Inbound) => Direction::Inbound,
        Ok(TrafficDirection::Outbound) => Direction::Outbound,
        _ => Direction::Unspecified,
    };
    let node = env.node_proto();
    let log_env = shunt_filters::common::access_log::Env {
        clusters,
        stats,
        node: &node,
    };
    let access_log = shunt_filters::common::access_log::compile(
        &listener.access_log,
        log_env,
        &path.field("access_log"),
        problems,
    );
    if problems.errors.len() > errors_before {
        return None;
    }
    Some(Listener {
        name: name.into(),
        addresses,
        bind_to_port: !internal && listener.bind_to_port.is_none_or(|b| b.value),
        internal,
        use_original_dst: listener.use_original_dst.is_some_and(|b| b.value),
        transparent: listener.transparent.is_some_and(|b| b.value),
        freebind: listener.freebind.is_some_and(|b| b.value),
        direction,
        listener_filters: filters,
        filter_chains,
        access_log,
        draining: Default::default(),
    })
}

/// `address` (none for an internal listener) and `additional_addresses`.
fn addresses(
    listener: &EnvoyListener,
    internal: bool,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Vec<SocketAddr> {
    let mut addresses = Vec::new();
    if internal {
        check_internal(listener, path, problems);
    } else if let Some(addr) =
        convert::ip_socket_addr(listener.address.as_ref(), &path.field("address"), problems)
    {
        addresses.push(addr);
    }
    for (j, additional) in listener.additional_addresses.iter().enumerate() {
        let a_path = path.field("additional_addresses").index(j).field("address");
        if let Some(addr) = convert::ip_socket_addr(additional.address.as_ref(), &a_path, problems)
        {
            addresses.push(addr);
        }
    }
    addresses
}

/// `listener_filters` and `listener_filters_timeout`; `use_original_dst` adds the
/// original_dst filter.
fn listener_filters(
    listener: &EnvoyListener,
    internal: bool,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> ListenerFilters {
    let mut filters = ListenerFilters {
        timeout: Some(DEFAULT_LISTENER_FILTERS_TIMEOUT),
        continue_on_timeout: listener.continue_on_listener_filters_timeout,
        ..Default::default()
    };
    if let Some(timeout) = &listener.listener_filters_timeout {
        let t = duration_or(
            Some(timeout),
            DEFAULT_LISTENER_FILTERS_TIMEOUT,
            &path.field("listener_filters_timeout"),
            problems,
        );
        // 0s disables the timeout, as in Envoy.
        filters.timeout = (!t.is_zero()).then_some(t);
    }
    for (j, filter) in listener.listener_filters.iter().enumerate() {
        let f_path = path.field("listener_filters").index(j);
        if filter.filter_disabled.is_some() {
            problems.warning(
                f_path.field("filter_disabled"),
                "not implemented; the filter always runs",
            );
        }
        match &filter.config_type {
            Some(listener_filter::ConfigType::TypedConfig(any)) => {
                match &*listener_filter_type(any) {
                    ORIGINAL_DST => filters.original_dst = true,
                    TLS_INSPECTOR => filters.tls_inspector = true,
                    HTTP_INSPECTOR => filters.http_inspector = true,
                    SET_INTERNAL_DST_ADDRESS if internal => filters.set_internal_dst_address = true,
                    SET_INTERNAL_DST_ADDRESS => {
                        problems.error(
                            f_path.field("typed_config"),
                            "set_internal_dst_address only works on an internal_listener",
                        );
                    }
                    other => {
                        problems.error(
                            f_path.field("typed_config"),
                            format!("listener filter {other} is not implemented yet"),
                        );
                    }
                }
            }
            Some(listener_filter::ConfigType::ConfigDiscovery(_)) => {
                problems.error(
                    f_path.field("config_discovery"),
                    "listener filters over ECDS are not implemented yet",
                );
            }
            None => {
                problems.error(
                    &f_path,
                    format!("listener filter {:?} has no typed_config", filter.name),
                );
            }
        }
    }
    // Envoy adds the original_dst listener filter itself to a `use_original_dst`
    // listener: Istio's virtualOutbound lists no listener filters and relies on it.
    if listener.use_original_dst.is_some_and(|b| b.value) {
        filters.original_dst = true;
    }
    filters
}

/// What compiling a filter chain needs besides the chain: the stats store, the
/// listener's stat prefix and the HTTP compile environment.
type ChainEnv<'a> = (
    &'a Store,
    Option<&'a str>,
    &'a shunt_filters::http::compile::Env,
);

/// `filter_chains`, `default_filter_chain` and `filter_chain_matcher`: the chains that
/// compiled, with their matches, checked for overlaps.
fn filter_chains(
    listener: &EnvoyListener,
    internal: bool,
    clusters: &Clusters,
    env: ChainEnv<'_>,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> FilterChains<Arc<FilterChain>> {
    let mut chains = Vec::new();
    // The config index of each compiled chain: a chain that failed to compile is absent.
    let mut config_index = Vec::new();
    for (j, chain) in listener.filter_chains.iter().enumerate() {
        let c_path = path.field("filter_chains").index(j);
        let errors_before = problems.errors.len();
        let matcher = chain_match(
            chain.filter_chain_match.as_ref(),
            &c_path.field("filter_chain_match"),
            problems,
        );
        // A match with a bad criterion would match more than it says: leave it out.
        let match_ok = problems.errors.len() == errors_before;
        let name = format!("filter_chains[{j}]");
        let compiled = compile_chain(chain, &name, clusters, env, &c_path, problems);
        if internal && chain.transport_socket.is_some() {
            problems.error(
                c_path.field("transport_socket"),
                "TLS on an internal listener's filter chain is not implemented",
            );
        }
        if let Some(compiled) = compiled
            && match_ok
        {
            chains.push((matcher, Arc::new(compiled)));
            config_index.push(j);
        }
    }
    let default = listener.default_filter_chain.as_ref().and_then(|chain| {
        let c_path = path.field("default_filter_chain");
        compile_chain(
            chain,
            "default_filter_chain",
            clusters,
            env,
            &c_path,
            problems,
        )
        .map(Arc::new)
    });
    let mut filter_chains = FilterChains::new(chains, default);
    if let Some(matcher) = &listener.filter_chain_matcher {
        // The matcher names chains; its actions point at their compiled places. A chain
        // that did not compile has its own error, and the listener is refused anyway.
        let by_name = |name: &str| {
            let j = listener.filter_chains.iter().position(|c| c.name == name)?;
            Some(
                config_index
                    .iter()
                    .position(|&k| k == j)
                    .unwrap_or(usize::MAX),
            )
        };
        if let Some(matcher) = ChainMatcher::compile(
            matcher,
            &by_name,
            &path.field("filter_chain_matcher"),
            problems,
        ) {
            filter_chains = filter_chains.with_matcher(matcher);
        }
    }
    if let Some((a, b)) = filter_chains.first_overlap() {
        let (a, b) = (config_index[a], config_index[b]);
        problems.error(
            path.field("filter_chains")
                .index(b)
                .field("filter_chain_match"),
            format!(
                "matches the same connections as filter_chains[{a}]; Envoy rejects such listeners"
            ),
        );
    }
    if listener.filter_chains.is_empty() && listener.default_filter_chain.is_none() {
        problems.error(
            path.field("filter_chains"),
            "a listener needs a filter chain or a default_filter_chain",
        );
    }
    filter_chains
}

/// The head of `udpa.type.v1.TypedStruct` / `xds.type.v3.TypedStruct` (both put
/// `type_url` first); the JSON `value` is not needed for the listener filters shunt
/// knows, whose configs say nothing it reads.
#[derive(Clone, PartialEq, prost::Message)]
struct TypedStructHead {
    #[prost(string, tag = "1")]
    type_url: String,
}

/// A listener filter's config type, looking inside a TypedStruct (istiod wraps Istio's
/// own listener filters in one).
fn listener_filter_type(any: &envoy_types::pb::google::protobuf::Any) -> std::borrow::Cow<'_, str> {
    let outer = convert::type_name(any);
    if !matches!(
        outer,
        "udpa.type.v1.TypedStruct" | "xds.type.v3.TypedStruct"
    ) {
        return outer.into();
    }
    match <TypedStructHead as prost::Message>::decode(any.value.as_slice()) {
        Ok(head) => head
            .type_url
            .rsplit('/')
            .next()
            .unwrap_or_default()
            .to_owned()
            .into(),
        Err(_) => outer.into(),
    }
}

/// What an `internal_listener` may not have: an address to bind.
fn check_internal(listener: &EnvoyListener, path: &JsonPath, problems: &mut Diagnostics) {
    if listener.address.is_some() || !listener.additional_addresses.is_empty() {
        problems.error(path.field("address"), "an internal_listener has no address");
    }
    if listener.use_original_dst.is_some_and(|b| b.value) {
        problems.error(
            path.field("use_original_dst"),
            "an internal_listener cannot hand connections off by address",
        );
    }
}

fn chain_match(
    m: Option<&EnvoyMatch>,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> FilterChainMatch {
    let Some(m) = m else {
        return FilterChainMatch::default();
    };
    let cidrs = |ranges: &[envoy_types::pb::envoy::config::core::v3::CidrRange],
                 field: &str,
                 problems: &mut Diagnostics| {
        ranges
            .iter()
            .enumerate()
            .filter_map(|(i, r)| convert::cidr(r, &path.field(field).index(i), problems))
            .collect::<Vec<_>>()
    };
    let destination_port = m
        .destination_port
        .and_then(|p| match u16::try_from(p.value) {
            Ok(port) if port > 0 => Some(port),
            _ => {
                problems.error(
                    path.field("destination_port"),
                    format!("{} is not a TCP port", p.value),
                );
                None
            }
        });
    let source_ports = m
        .source_ports
        .iter()
        .enumerate()
        .filter_map(|(i, &p)| match u16::try_from(p) {
            Ok(port) if port > 0 => Some(port),
            _ => {
                problems.error(
                    path.field("source_ports").index(i),
                    format!("{p} is not a TCP port"),
                );
                None
            }
        })
        .collect();
    for (i, name) in m.server_names.iter().enumerate() {
        if name.contains('*') && !(name.starts_with("*.") && name[1..].find('*').is_none()) {
            problems.error(
                path.field("server_names").index(i),
                format!("{name:?}: a wildcard must be a leading \"*.\""),
            );
        }
    }
    FilterChainMatch {
        destination_port,
        prefix_ranges: cidrs(&m.prefix_ranges, "prefix_ranges", problems),
        server_names: m
            .server_names
            .iter()
            .map(|s| s.to_ascii_lowercase())
            .collect(),
        transport_protocol: m.transport_protocol.clone(),
        application_protocols: m.application_protocols.clone(),
        direct_source_prefix_ranges: cidrs(
            &m.direct_source_prefix_ranges,
            "direct_source_prefix_ranges",
            problems,
        ),
        source_type: match ConnectionSourceType::try_from(m.source_type) {
            Ok(ConnectionSourceType::SameIpOrLoopback) => SourceType::SameIpOrLoopback,
            Ok(ConnectionSourceType::External) => SourceType::External,
            _ => SourceType::Any,
        },
        source_prefix_ranges: cidrs(&m.source_prefix_ranges, "source_prefix_ranges", problems),
        source_ports,
    }
}

/// `stats`: the store, and the listener's stat prefix (for its connection managers'
/// `listener.<prefix>.http.<stat_prefix>.*`).
fn compile_chain(
    chain: &EnvoyFilterChain,
    default_name: &str,
    clusters: &Clusters,
    (stats, listener_prefix, env): ChainEnv<'_>,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<FilterChain> {
    let transport_socket = match &chain.transport_socket {
        Some(socket) => shunt_tls::transport_socket::downstream(
            socket,
            &path.field("transport_socket"),
            problems,
        )
        .ok()?,
        None => None,
    };
    let mut network = None;
    let mut filters = shunt_filters::network::NetworkFilters::default();
    for (k, f) in chain.filters.iter().enumerate() {
        let f_path = path.field("filters").index(k);
        if network.is_some() {
            problems.error(&f_path, "comes after the terminal network filter");
            return None;
        }
        let any = match &f.config_type {
            Some(filter::ConfigType::TypedConfig(any)) => any,
            Some(filter::ConfigType::ConfigDiscovery(_)) => {
                problems.error(
                    f_path.field("config_discovery"),
                    "network filters over ECDS are not implemented yet",
                );
                return None;
            }
            None => {
                problems.error(
                    &f_path,
                    format!("network filter {:?} has no typed_config", f.name),
                );
                return None;
            }
        };
        let typed_path = f_path.field("typed_config");
        let any = shunt_config::typed_struct::unwrap(any, &typed_path, problems)?;
        if let Some(refusal) = convert::wasm_unsupported(convert::type_name(&any), &f.name) {
            problems.error(&typed_path, refusal);
            return None;
        }
        match convert::type_name(&any) {
            TCP_PROXY => {
                let config = decode::<EnvoyTcpProxy>(&any, &typed_path, problems)?;
                let mut proxy = tcp_proxy::compile(
                    &config,
                    clusters,
                    stats,
                    &env.node_proto(),
                    &typed_path,
                    problems,
                )?;
                proxy.node = env.node.clone();
                network = Some(NetworkFilter::TcpProxy(proxy));
            }
            HCM => {
                let config = decode::<EnvoyHcm>(&any, &typed_path, problems)?;
                let mut hcm = shunt_filters::http::compile::compile_in(
                    &config,
                    clusters,
                    stats,
                    env,
                    &typed_path,
                    problems,
                )?;
                if let Some(listener_prefix) = listener_prefix {
                    hcm.stats.listener = shunt_filters::http::config::ListenerHttpStats::new(
                        stats,
                        listener_prefix,
                        &config.stat_prefix,
                    );
                }
                network = Some(NetworkFilter::Http(Arc::new(hcm)));
            }
            other => {
                let Some(factory) = shunt_filters::network::registry::find(other) else {
                    problems.error(
                        &typed_path,
                        format!("network filter {other} is not implemented yet"),
                    );
                    return None;
                };
                let ctx = shunt_filters::network::registry::CompileCtx {
                    name: &f.name,
                    stats,
                    clusters,
                    node: &env.node,
                    inbound: env.inbound,
                };
                let compiled = (factory.compile)(&any, &ctx, &typed_path, problems)?;
                filters.filters.push((f.name.clone(), compiled));
            }
        }
    }
    let Some(network) = network else {
        problems.error(
            path.field("filters"),
            "a filter chain needs a terminal network filter (tcp_proxy or http_connection_manager)",
        );
        return None;
    };
    Some(FilterChain {
        name: if chain.name.is_empty() {
            default_name.to_owned()
        } else {
            chain.name.clone()
        },
        transport_socket,
        transport_socket_connect_timeout: chain
            .transport_socket_connect_timeout
            .as_ref()
            .and_then(|t| {
                convert::duration(t, &path.field("transport_socket_connect_timeout"), problems)
            })
            .filter(|t| !t.is_zero()),
        filters,
        network,
    })
}
