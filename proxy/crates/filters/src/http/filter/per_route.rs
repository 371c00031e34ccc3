//! Compiling `typed_per_filter_config` (on a route configuration, virtual host, route or
//! weighted cluster): filter name to its per-route config, `disabled` and `is_optional`
//! (Envoy's `envoy.config.route.v3.FilterConfig` wrapper), each config by the filter
//! the [`super::registry`] finds for its type. What it compiles to is in
//! [`crate::http::route`], which routes hold.

use std::collections::HashMap;

use envoy_types::pb::envoy::config::route::v3::FilterConfig;
use envoy_types::pb::google::protobuf::Any as PbAny;

use crate::http::route::{PerFilterConfig, PerFilterConfigs};
use shunt_config::convert::{decode, type_name};
use shunt_config::{Diagnostics, JsonPath};

const FILTER_CONFIG: &str = "envoy.config.route.v3.FilterConfig";

/// Compiles `typed_per_filter_config` at `path`. A per-route type no filter of shunt
/// compiles is a warning (the filter itself is refused or skipped where it is
/// configured); one that does not compile is an error.
pub fn compile(
    configs: &HashMap<String, PbAny>,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> PerFilterConfigs {
    let mut compiled = PerFilterConfigs::new();
    // Sorted, so diagnostics come in a stable order.
    let mut names: Vec<_> = configs.keys().collect();
    names.sort();
    for name in names {
        let e_path = path.key(name);
        if let Some(entry) = compile_one(name, &configs[name], &e_path, problems) {
            compiled.insert(name.clone(), entry);
        }
    }
    compiled
}

fn compile_one(
    name: &str,
    any: &PbAny,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<PerFilterConfig> {
    let any = shunt_config::typed_struct::unwrap(any, path, problems)?;
    let (disabled, is_optional, inner, inner_path) = if type_name(&any) == FILTER_CONFIG {
        let wrapper = decode::<FilterConfig>(&any, path, problems)?;
        let inner = match wrapper.config {
            Some(config) => Some(
                shunt_config::typed_struct::unwrap(&config, &path.field("config"), problems)?
                    .into_owned(),
            ),
            None => None,
        };
        (
            wrapper.disabled,
            wrapper.is_optional,
            inner,
            path.field("config"),
        )
    } else {
        (false, false, Some(any.into_owned()), path.to_owned())
    };
    let Some(inner) = inner else {
        return Some(PerFilterConfig {
            disabled,
            config: None,
        });
    };
    let kind = type_name(&inner);
    let Some(compile) = super::registry::find_per_route(kind) else {
        let why = if is_optional {
            "it is optional"
        } else {
            "the filter is not implemented"
        };
        problems.warning(
            &inner_path,
            format!("per-route config {kind} for HTTP filter {name:?} is ignored: {why}"),
        );
        return Some(PerFilterConfig {
            disabled,
            config: None,
        });
    };
    let config = compile(&inner, &inner_path, problems)?;
    Some(PerFilterConfig {
        disabled,
        config: Some(config),
    })
}
