//! `/config_dump`: every resource in use as an `envoy.admin.v3.ConfigDump`, built and
//! filtered the way Envoy's `config_dump_handler.cc` does.
//!
//! - The dump holds one message per config type, in Envoy's order: BootstrapConfigDump,
//!   ClustersConfigDump, EndpointsConfigDump (only with `?include_eds`),
//!   ListenersConfigDump, ScopedRoutesConfigDump, RoutesConfigDump, SecretsConfigDump;
//!   then, with the DNS proxy on, Istio's `istio.networking.nds.v1.NameTable` in use.
//! - `?resource=static_clusters` dumps the elements of the first config's repeated field
//!   of that name instead, each packed on its own.
//! - `?mask=a.b,c` is a protobuf field mask: on each config (those it does not fit are
//!   left out), or with `resource` on each element, reaching into its one `Any` field
//!   (`?resource=static_clusters&mask=cluster.name`).
//! - `?name_regex=` keeps only resources whose name matches (the whole name).
//! - Fields annotated `udpa.annotations.sensitive` (private keys, passwords, generic
//!   secrets) are redacted as Envoy redacts them: strings and bytes become `[redacted]`,
//!   other values are cleared, inside `Any`s too.
//!
//! The work happens on prost-reflect messages over the config module's descriptor pool,
//! because masks and redaction walk Envoy's schema; the result is written through
//! [`shunt_config::message_to_json`], the writer of the bootstrap too.

use std::collections::{BTreeMap, HashSet};
use std::sync::OnceLock;
use std::time::{SystemTime, UNIX_EPOCH};

use envoy_types::pb::envoy::admin::v3::{
    BootstrapConfigDump, ClientResourceStatus, ClustersConfigDump, ConfigDump, EndpointsConfigDump,
    ListenersConfigDump, RoutesConfigDump, ScopedRoutesConfigDump, SecretsConfigDump,
    UpdateFailureState, clusters_config_dump, endpoints_config_dump, listeners_config_dump,
    routes_config_dump, secrets_config_dump,
};
use envoy_types::pb::google::protobuf::{Any, Timestamp};
use hyper::StatusCode;
use prost::{Message, Name};
use prost_reflect::{
    DescriptorPool, DynamicMessage, Kind, MessageDescriptor, ReflectMessage, Value,
};
use regex::Regex;

use super::state::ProxyState;
use shunt_config::{Resources, UpdateFailure};

/// The query parameters of `/config_dump`.
#[derive(Debug, Clone, Default)]
pub struct Params {
    pub resource: Option<String>,
    pub mask: Option<String>,
    pub name_regex: Option<String>,
    pub include_eds: bool,
}

/// An error answer: status and plain-text body.
pub type Failure = (StatusCode, String);

const TYPE_URL_PREFIX: &str = "type.googleapis.com/";
const ANY: &str = "google.protobuf.Any";

/// Builds the dump for `params`, as proto3 JSON.
pub fn config_dump(
    state: &dyn ProxyState,
    started: SystemTime,
    params: &Params,
) -> Result<serde_json::Value, Failure> {
    let pool = &shunt_config::descriptor_pool().map_err(internal)?;
    let names = NameFilter::new(params.name_regex.as_deref())?;
    let configs = configs(state, started, &names, params.include_eds, pool)?;
    let mut packed = match &params.resource {
        Some(resource) => select_resource(configs, resource, params.mask.as_deref(), pool)?,
        None => mask_configs(configs, params.mask.as_deref())?,
    };
    for message in &mut packed {
        redact(message, false, pool);
    }
    let dump = ConfigDump {
        configs: packed.iter().map(pack).collect(),
    };
    shunt_config::message_to_json(&dump).map_err(internal)
}

fn internal(err: impl std::fmt::Display) -> Failure {
    (StatusCode::INTERNAL_SERVER_ERROR, format!("{err}\n"))
}

/// `?name_regex=`: a whole-name match, as Envoy's RE2 matcher.
struct NameFilter(Option<Regex>);

impl NameFilter {
    fn new(pattern: Option<&str>) -> Result<Self, Failure> {
        match pattern.filter(|p| !p.is_empty()) {
            None => Ok(NameFilter(None)),
            Some(pattern) => Regex::new(&format!("^(?:{pattern})$"))
                .map(|regex| NameFilter(Some(regex)))
                .map_err(|err| {
                    (
                        StatusCode::BAD_REQUEST,
                        format!("Error while parsing name_regex from {pattern}: {err}"),
                    )
                }),
        }
    }

    fn keeps(&self, name: &str) -> bool {
        self.0.as_ref().is_none_or(|regex| regex.is_match(name))
    }
}

/// Each config type's message, in Envoy's order.
fn configs(
    state: &dyn ProxyState,
    started: SystemTime,
    names: &NameFilter,
    include_eds: bool,
    pool: &DescriptorPool,
) -> Result<Vec<DynamicMessage>, Failure> {
    let mut resources = state.resources();
    // Envoy keeps clusters in a map by name; listeners and routes in the order added.
    resources
        .clusters
        .sort_by(|a, b| a.resource.name.cmp(&b.resource.name));
    resources
        .endpoints
        .sort_by(|a, b| a.resource.cluster_name.cmp(&b.resource.cluster_name));
    let bootstrap = BootstrapConfigDump {
        bootstrap: Some(state.bootstrap()),
        last_updated: Some(timestamp(started)),
    };
    let mut configs = vec![
        dynamic(&bootstrap, pool)?,
        dynamic(&clusters_dump(&resources, names), pool)?,
    ];
    // Envoy adds endpoints only when there are clusters to take them from.
    if include_eds && !resources.clusters.is_empty() {
        configs.push(dynamic(&endpoints_dump(&resources, names), pool)?);
    }
    configs.extend([
        dynamic(&listeners_dump(&resources, names), pool)?,
        dynamic(&ScopedRoutesConfigDump::default(), pool)?,
        dynamic(&routes_dump(&resources, names), pool)?,
        dynamic(&secrets_dump(&resources, names), pool)?,
    ]);
    // Not Envoy's: the DNS proxy's name table, as istiod sent it (pilot-agent shows it
    // on its own debug endpoint; shunt has one dump).
    if let Some(table) = state.name_table() {
        let desc = pool
            .get_message_by_name(NAME_TABLE)
            .ok_or_else(|| internal(format!("{NAME_TABLE} is not in the pool")))?;
        configs.push(DynamicMessage::decode(desc, table.value.as_slice()).map_err(internal)?);
    }
    Ok(configs)
}

/// The `error_state` of a resource whose last xDS update was refused.
fn error_state(errors: &[UpdateFailure], type_url: &str, name: &str) -> Option<UpdateFailureState> {
    errors
        .iter()
        .find(|e| e.type_url.ends_with(type_url) && e.name == name)
        .map(failure_state)
}

/// Static, active, warming and refused clusters.
fn clusters_dump(resources: &Resources, names: &NameFilter) -> ClustersConfigDump {
    let Resources {
        clusters,
        clusters_version,
        warming_clusters,
        errors,
        ..
    } = resources;
    let mut dump = ClustersConfigDump {
        version_info: clusters_version.clone(),
        ..Default::default()
    };
    for tracked in clusters.iter().filter(|c| names.keeps(&c.resource.name)) {
        let cluster = Some(any(&tracked.resource));
        let last_updated = Some(timestamp(tracked.last_updated));
        match &tracked.version_info {
            None => dump
                .static_clusters
                .push(clusters_config_dump::StaticCluster {
                    cluster,
                    last_updated,
                }),
            Some(version) => {
                dump.dynamic_active_clusters
                    .push(clusters_config_dump::DynamicCluster {
                        version_info: version.to_string(),
                        cluster,
                        last_updated,
                        error_state: error_state(errors, CLUSTER, &tracked.resource.name),
                        client_status: ClientResourceStatus::Acked as i32,
                    })
            }
        }
    }
    for tracked in warming_clusters
        .iter()
        .filter(|c| names.keeps(&c.resource.name))
    {
        dump.dynamic_warming_clusters
            .push(clusters_config_dump::DynamicCluster {
                version_info: tracked
                    .version_info
                    .as_deref()
                    .unwrap_or_default()
                    .to_owned(),
                cluster: Some(any(&tracked.resource)),
                last_updated: Some(timestamp(tracked.last_updated)),
                error_state: None,
                client_status: ClientResourceStatus::Acked as i32,
            });
    }
    // A refused cluster that has no accepted version shows as its error alone.
    for error in errors.iter().filter(|e| e.type_url.ends_with(CLUSTER)) {
        let known = clusters.iter().any(|c| c.resource.name == error.name);
        if !known && names.keeps(&error.name) {
            dump.dynamic_active_clusters
                .push(clusters_config_dump::DynamicCluster {
                    error_state: Some(failure_state(error)),
                    client_status: ClientResourceStatus::Nacked as i32,
                    ..Default::default()
                });
        }
    }
    dump
}

/// The endpoints of each cluster as the load balancer has them (`?include_eds`).
fn endpoints_dump(resources: &Resources, names: &NameFilter) -> EndpointsConfigDump {
    let mut dump = EndpointsConfigDump::default();
    for tracked in resources
        .endpoints
        .iter()
        .filter(|e| names.keeps(&e.resource.cluster_name))
    {
        let endpoint_config = Some(any(&tracked.resource));
        match &tracked.version_info {
            None => {
                dump.static_endpoint_configs
                    .push(endpoints_config_dump::StaticEndpointConfig {
                        endpoint_config,
                        last_updated: None,
                    })
            }
            Some(version) => {
                dump.dynamic_endpoint_configs
                    .push(endpoints_config_dump::DynamicEndpointConfig {
                        version_info: version.to_string(),
                        endpoint_config,
                        last_updated: Some(timestamp(tracked.last_updated)),
                        client_status: ClientResourceStatus::Acked as i32,
                        ..Default::default()
                    })
            }
        }
    }
    dump
}

/// Static and dynamic listeners, each dynamic one with its active and warming state
/// and its refused update.
fn listeners_dump(resources: &Resources, names: &NameFilter) -> ListenersConfigDump {
    let Resources {
        listeners,
        listeners_version,
        warming_listeners,
        errors,
        ..
    } = resources;
    let mut dump = ListenersConfigDump {
        version_info: listeners_version.clone(),
        ..Default::default()
    };
    for tracked in listeners.iter().filter(|l| names.keeps(&l.resource.name)) {
        let listener = Some(any(&tracked.resource));
        let last_updated = Some(timestamp(tracked.last_updated));
        match &tracked.version_info {
            None => dump
                .static_listeners
                .push(listeners_config_dump::StaticListener {
                    listener,
                    last_updated,
                }),
            Some(version) => dump
                .dynamic_listeners
                .push(listeners_config_dump::DynamicListener {
                    name: tracked.resource.name.clone(),
                    active_state: Some(listeners_config_dump::DynamicListenerState {
                        version_info: version.to_string(),
                        listener,
                        last_updated,
                    }),
                    error_state: error_state(errors, LISTENER, &tracked.resource.name),
                    client_status: ClientResourceStatus::Acked as i32,
                    ..Default::default()
                }),
        }
    }
    // A warming version joins its active one, or stands alone until it is served.
    for tracked in warming_listeners
        .iter()
        .filter(|l| names.keeps(&l.resource.name))
    {
        let warming = Some(listeners_config_dump::DynamicListenerState {
            version_info: tracked
                .version_info
                .as_deref()
                .unwrap_or_default()
                .to_owned(),
            listener: Some(any(&tracked.resource)),
            last_updated: Some(timestamp(tracked.last_updated)),
        });
        match dump
            .dynamic_listeners
            .iter_mut()
            .find(|l| l.name == tracked.resource.name)
        {
            Some(active) => active.warming_state = warming,
            None => dump
                .dynamic_listeners
                .push(listeners_config_dump::DynamicListener {
                    name: tracked.resource.name.clone(),
                    warming_state: warming,
                    error_state: error_state(errors, LISTENER, &tracked.resource.name),
                    client_status: ClientResourceStatus::Acked as i32,
                    ..Default::default()
                }),
        }
    }
    for error in errors.iter().filter(|e| e.type_url.ends_with(LISTENER)) {
        let known = listeners
            .iter()
            .chain(warming_listeners)
            .any(|l| l.resource.name == error.name);
        if !known && names.keeps(&error.name) {
            dump.dynamic_listeners
                .push(listeners_config_dump::DynamicListener {
                    name: error.name.clone(),
                    error_state: Some(failure_state(error)),
                    client_status: ClientResourceStatus::Nacked as i32,
                    ..Default::default()
                });
        }
    }
    dump
}

/// Static (inline) and RDS route configurations.
fn routes_dump(resources: &Resources, names: &NameFilter) -> RoutesConfigDump {
    let mut dump = RoutesConfigDump::default();
    for tracked in resources
        .route_configs
        .iter()
        .filter(|r| names.keeps(&r.resource.name))
    {
        let route_config = Some(any(&tracked.resource));
        let last_updated = Some(timestamp(tracked.last_updated));
        match &tracked.version_info {
            None => dump
                .static_route_configs
                .push(routes_config_dump::StaticRouteConfig {
                    route_config,
                    last_updated,
                }),
            Some(version) => {
                dump.dynamic_route_configs
                    .push(routes_config_dump::DynamicRouteConfig {
                        version_info: version.to_string(),
                        route_config,
                        last_updated,
                        error_state: error_state(
                            &resources.errors,
                            ROUTE_CONFIGURATION,
                            &tracked.resource.name,
                        ),
                        client_status: ClientResourceStatus::Acked as i32,
                    })
            }
        }
    }
    dump
}

/// Static and SDS secrets.
fn secrets_dump(resources: &Resources, names: &NameFilter) -> SecretsConfigDump {
    let mut dump = SecretsConfigDump::default();
    for tracked in resources
        .secrets
        .iter()
        .filter(|s| names.keeps(&s.resource.name))
    {
        let secret = Some(any(&tracked.resource));
        let name = tracked.resource.name.clone();
        let last_updated = Some(timestamp(tracked.last_updated));
        match &tracked.version_info {
            None => dump.static_secrets.push(secrets_config_dump::StaticSecret {
                name,
                last_updated,
                secret,
            }),
            Some(version) => dump
                .dynamic_active_secrets
                .push(secrets_config_dump::DynamicSecret {
                    name,
                    version_info: version.to_string(),
                    last_updated,
                    secret,
                    ..Default::default()
                }),
        }
    }
    dump
}

const CLUSTER: &str = "envoy.config.cluster.v3.Cluster";
const NAME_TABLE: &str = "istio.networking.nds.v1.NameTable";
const LISTENER: &str = "envoy.config.listener.v3.Listener";
const ROUTE_CONFIGURATION: &str = "envoy.config.route.v3.RouteConfiguration";

fn failure_state(failure: &UpdateFailure) -> UpdateFailureState {
    UpdateFailureState {
        failed_configuration: failure.failed_configuration.clone(),
        last_update_attempt: Some(timestamp(failure.last_update_attempt)),
        details: failure.details.clone(),
        version_info: failure.version_info.clone(),
    }
}

/// A timestamp in milliseconds, as Envoy's dumps show them.
fn timestamp(at: SystemTime) -> Timestamp {
    let since = at.duration_since(UNIX_EPOCH).unwrap_or_default();
    Timestamp {
        seconds: since.as_secs() as i64,
        nanos: (since.subsec_millis() * 1_000_000) as i32,
    }
}

fn any<M: Message + Name>(message: &M) -> Any {
    Any {
        type_url: M::type_url(),
        value: message.encode_to_vec(),
    }
}

fn dynamic<M: Message + Name>(
    message: &M,
    pool: &DescriptorPool,
) -> Result<DynamicMessage, Failure> {
    let desc = pool
        .get_message_by_name(&M::full_name())
        .ok_or_else(|| internal(format!("{} is not in the pool", M::full_name())))?;
    DynamicMessage::decode(desc, message.encode_to_vec().as_slice()).map_err(internal)
}

fn pack(message: &DynamicMessage) -> Any {
    Any {
        type_url: format!("{TYPE_URL_PREFIX}{}", message.descriptor().full_name()),
        value: message.encode_to_vec(),
    }
}

/// `?mask=` without `?resource=`: trims every config the mask fits, drops the others.
fn mask_configs(
    configs: Vec<DynamicMessage>,
    mask: Option<&str>,
) -> Result<Vec<DynamicMessage>, Failure> {
    let Some(mask) = mask else {
        return Ok(configs);
    };
    let paths = parse_mask(mask);
    let kept: Vec<DynamicMessage> = configs
        .into_iter()
        .filter_map(|mut config| check_and_trim(&paths, &mut config).then_some(config))
        .collect();
    if kept.is_empty() {
        return Err((
            StatusCode::BAD_REQUEST,
            format!("FieldMask {mask} could not be successfully applied to any configs."),
        ));
    }
    Ok(kept)
}

/// `?resource=`: the elements of the first config's repeated field of that name.
fn select_resource(
    configs: Vec<DynamicMessage>,
    resource: &str,
    mask: Option<&str>,
    pool: &DescriptorPool,
) -> Result<Vec<DynamicMessage>, Failure> {
    for config in configs {
        let Some(field) = config.descriptor().get_field_by_name(resource) else {
            continue;
        };
        if !field.is_list() {
            return Err((
                StatusCode::BAD_REQUEST,
                format!(
                    "{0} is not a repeated field. Use ?mask={0} to get only this field",
                    field.name()
                ),
            ));
        }
        let Value::List(items) = config.get_field(&field).into_owned() else {
            return Ok(Vec::new());
        };
        let paths = mask.map(parse_mask);
        let mut selected = Vec::new();
        for item in items {
            let Value::Message(mut message) = item else {
                continue;
            };
            if let Some(paths) = &paths
                && !trim_resource(paths, &mut message, pool)
            {
                return Err((
                    StatusCode::BAD_REQUEST,
                    format!(
                        "FieldMask paths: \"{}\" could not be successfully used.",
                        paths.join("\" paths: \"")
                    ),
                ));
            }
            selected.push(message);
        }
        return Ok(selected);
    }
    Err((
        StatusCode::NOT_FOUND,
        format!("{resource} not found in config dump"),
    ))
}

/// `FieldMaskUtil::FromString`: comma-separated paths, empty ones dropped.
fn parse_mask(mask: &str) -> Vec<String> {
    mask.split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .map(str::to_owned)
        .collect()
}

/// Envoy's `trimResourceMessage`: paths that start with the element's (one) `Any` field
/// apply inside the resource it holds; the rest apply to the element itself.
fn trim_resource(paths: &[String], message: &mut DynamicMessage, pool: &DescriptorPool) -> bool {
    let desc = message.descriptor();
    let mut outer = Vec::new();
    let mut inner = Vec::new();
    let mut any_field = None;
    for path in paths {
        let (head, rest) = path.split_once('.').unwrap_or((path, ""));
        let is_any = desc.get_field_by_name(head).is_some_and(|field| {
            !field.is_list() && matches!(field.kind(), Kind::Message(m) if m.full_name() == ANY)
        });
        if is_any {
            any_field = Some(head.to_owned());
            outer.push(head.to_owned());
            if !rest.is_empty() {
                inner.push(rest.to_owned());
            }
        } else {
            outer.push(path.clone());
        }
    }
    if let Some(name) = any_field
        && !inner.is_empty()
        && let Some(field) = desc.get_field_by_name(&name)
        && message.has_field(&field)
        && let Value::Message(any) = message.get_field_mut(&field)
    {
        let Some(mut payload) = unpack(any, pool) else {
            return false;
        };
        if !check_and_trim(&inner, &mut payload) {
            return false;
        }
        repack(any, &payload);
    }
    check_and_trim(&outer, message)
}

/// Whether every path names fields of the message (through singular messages only), and
/// if so, `FieldMaskUtil::TrimMessage`: clear every field the mask does not cover.
fn check_and_trim(paths: &[String], message: &mut DynamicMessage) -> bool {
    if !paths
        .iter()
        .all(|path| path_is_valid(&message.descriptor(), path))
    {
        return false;
    }
    let mut tree = MaskTree::default();
    for path in paths {
        tree.insert(path.split('.'));
    }
    tree.trim(message);
    true
}

fn path_is_valid(desc: &MessageDescriptor, path: &str) -> bool {
    let mut desc = desc.clone();
    let mut segments = path.split('.').peekable();
    while let Some(segment) = segments.next() {
        let Some(field) = desc.get_field_by_name(segment) else {
            return false;
        };
        if segments.peek().is_some() {
            match field.kind() {
                Kind::Message(inner) if !field.is_list() && !field.is_map() => desc = inner,
                _ => return false,
            }
        }
    }
    true
}

/// A field mask as a tree: a node with no children keeps its whole field.
#[derive(Debug, Default)]
struct MaskTree {
    children: BTreeMap<String, MaskTree>,
    whole: bool,
}

impl MaskTree {
    fn insert<'a>(&mut self, mut segments: impl Iterator<Item = &'a str>) {
        let Some(segment) = segments.next() else {
            self.whole = true;
            self.children.clear();
            return;
        };
        if self.whole && !self.children.is_empty() {
            return;
        }
        let child = self.children.entry(segment.to_owned()).or_default();
        if child.whole {
            return;
        }
        child.insert(segments);
    }

    fn trim(&self, message: &mut DynamicMessage) {
        for field in message.descriptor().fields() {
            match self.children.get(field.name()) {
                None => message.clear_field(&field),
                Some(node) if node.whole => {}
                Some(node) => {
                    if message.has_field(&field)
                        && let Value::Message(inner) = message.get_field_mut(&field)
                    {
                        node.trim(inner);
                    }
                }
            }
        }
    }
}

fn unpack(any: &DynamicMessage, pool: &DescriptorPool) -> Option<DynamicMessage> {
    let type_url = match any.get_field_by_name("type_url")?.into_owned() {
        Value::String(url) => url,
        _ => return None,
    };
    let value = match any.get_field_by_name("value")?.into_owned() {
        Value::Bytes(bytes) => bytes,
        _ => return None,
    };
    let name = type_url.rsplit('/').next().unwrap_or(&type_url);
    let desc = pool.get_message_by_name(name)?;
    DynamicMessage::decode(desc, value).ok()
}

fn repack(any: &mut DynamicMessage, payload: &DynamicMessage) {
    any.set_field_by_name("value", Value::Bytes(payload.encode_to_vec().into()));
}

/// Envoy's `MessageUtil::redact`.
fn redact(message: &mut DynamicMessage, ancestor_is_sensitive: bool, pool: &DescriptorPool) {
    if message.descriptor().full_name() == ANY {
        if let Some(mut payload) = unpack(message, pool) {
            redact(&mut payload, ancestor_is_sensitive, pool);
            repack(message, &payload);
        }
        return;
    }
    let sensitive_fields = sensitive_fields(pool);
    for field in message.descriptor().fields() {
        if !message.has_field(&field) {
            continue;
        }
        let sensitive = ancestor_is_sensitive || sensitive_fields.contains(field.full_name());
        match field.kind() {
            Kind::Message(_) => match message.get_field_mut(&field) {
                Value::Message(inner) => redact(inner, sensitive, pool),
                Value::List(items) => items.iter_mut().for_each(|item| {
                    if let Value::Message(inner) = item {
                        redact(inner, sensitive, pool);
                    }
                }),
                Value::Map(entries) => entries.values_mut().for_each(|item| {
                    if let Value::Message(inner) = item {
                        redact(inner, sensitive, pool);
                    }
                }),
                _ => {}
            },
            Kind::String | Kind::Bytes if sensitive => {
                let redacted = |kind: &Kind| match kind {
                    Kind::String => Value::String("[redacted]".into()),
                    _ => Value::Bytes("[redacted]".as_bytes().to_vec().into()),
                };
                let kind = field.kind();
                match message.get_field_mut(&field) {
                    Value::List(items) => items.iter_mut().for_each(|item| *item = redacted(&kind)),
                    value => *value = redacted(&kind),
                }
            }
            _ if sensitive => message.clear_field(&field),
            _ => {}
        }
    }
}

/// The full names of the fields annotated `[(udpa.annotations.sensitive) = true]`, found
/// once by scanning the pool.
fn sensitive_fields(pool: &DescriptorPool) -> &'static HashSet<String> {
    static FIELDS: OnceLock<HashSet<String>> = OnceLock::new();
    FIELDS.get_or_init(|| {
        let Some(extension) = pool.get_extension_by_name("udpa.annotations.sensitive") else {
            tracing::warn!("udpa.annotations.sensitive is not in the pool: nothing is redacted");
            return HashSet::new();
        };
        pool.all_messages()
            .flat_map(|message| message.fields().collect::<Vec<_>>())
            .filter(|field| {
                let options = field.options();
                options.has_extension(&extension)
                    && matches!(
                        options.get_extension(&extension).as_ref(),
                        Value::Bool(true)
                    )
            })
            .map(|field| field.full_name().to_owned())
            .collect()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envoys_sensitive_fields_are_known() {
        let pool = &shunt_config::descriptor_pool().unwrap();
        let fields = sensitive_fields(pool);
        for name in [
            "envoy.extensions.transport_sockets.tls.v3.TlsCertificate.private_key",
            "envoy.extensions.transport_sockets.tls.v3.TlsCertificate.password",
            "envoy.extensions.transport_sockets.tls.v3.GenericSecret.secret",
            "envoy.extensions.transport_sockets.tls.v3.TlsSessionTicketKeys.keys",
        ] {
            assert!(fields.contains(name), "{name} not sensitive: {fields:?}");
        }
        assert!(!fields.contains(
            "envoy.extensions.transport_sockets.tls.v3.TlsCertificate.certificate_chain"
        ));
    }

    #[test]
    fn a_mask_keeps_only_its_paths() {
        let pool = &shunt_config::descriptor_pool().unwrap();
        let dump = BootstrapConfigDump {
            bootstrap: Some(envoy_types::pb::envoy::config::bootstrap::v3::Bootstrap {
                node: Some(envoy_types::pb::envoy::config::core::v3::Node {
                    id: "n".into(),
                    cluster: "c".into(),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            last_updated: Some(timestamp(SystemTime::now())),
        };
        let mut message = dynamic(&dump, pool).unwrap();
        assert!(check_and_trim(&["bootstrap.node.id".into()], &mut message));
        let trimmed: BootstrapConfigDump = message.transcode_to().unwrap();
        assert_eq!(trimmed.last_updated, None);
        let node = trimmed.bootstrap.unwrap().node.unwrap();
        assert_eq!((node.id.as_str(), node.cluster.as_str()), ("n", ""));

        let mut message = dynamic(&dump, pool).unwrap();
        assert!(!check_and_trim(&["bootstrap.nope".into()], &mut message));
        assert!(!path_is_valid(
            &message.descriptor(),
            "bootstrap.static_resources.clusters.name"
        ));
    }
}
