//! Envoy's `set_filter_state` network filter
//! (`envoy.extensions.filters.network.set_filter_state.v3.Config`): its
//! `on_new_connection` values become connection-lived filter state before the
//! terminal filter starts (what Istio's `connect_authority` network filter is now:
//! re-sharing the tunnel's original destination with the upstream).

use std::sync::Arc;

use envoy_types::pb::envoy::extensions::filters::network::set_filter_state::v3::Config;
use envoy_types::pb::google::protobuf::Any;

use crate::network::factory::{CompileCtx, Factory};
use crate::network::{NetworkFilter, NetworkFilterConfig, NetworkFlow, NewConnection};
use shunt_config::{Diagnostics, JsonPath, convert::decode};
use shunt_core::formatter::Context;
use shunt_core::set_filter_state::{ValueSetter, compile as compile_values, store};
use shunt_core::stream_info::LifeSpan;

pub const TYPE: &str = "envoy.extensions.filters.network.set_filter_state.v3.Config";

pub const FACTORY: Factory = Factory {
    type_name: TYPE,
    compile,
};

#[derive(Debug)]
struct SetFilterState {
    on_new_connection: Arc<[ValueSetter]>,
}

fn compile(
    any: &Any,
    _ctx: &CompileCtx<'_>,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<Arc<dyn NetworkFilterConfig>> {
    let config: Config = decode(any, path, problems)?;
    for (field, values) in [
        (
            "on_downstream_tls_handshake",
            &config.on_downstream_tls_handshake,
        ),
        ("on_downstream_data", &config.on_downstream_data),
    ] {
        if !values.is_empty() {
            problems.error(path.field(field), "is not implemented");
            return None;
        }
    }
    let on_new_connection = compile_values(
        &config.on_new_connection,
        &path.field("on_new_connection"),
        problems,
    )?;
    Some(Arc::new(SetFilterState {
        on_new_connection: on_new_connection.into(),
    }))
}

impl NetworkFilterConfig for SetFilterState {
    fn create(&self) -> Box<dyn NetworkFilter> {
        Box::new(Active(self.on_new_connection.clone()))
    }
}

struct Active(Arc<[ValueSetter]>);

impl NetworkFilter for Active {
    fn on_new_connection<'a>(&'a mut self, ctx: &'a mut NewConnection<'_>) -> NetworkFlow<'a> {
        for setter in self.0.iter() {
            // Each value sees what the ones before it set.
            let entry = setter.render(&Context::connection(ctx.connection), LifeSpan::Connection);
            if let Some(entry) = entry {
                store(&mut ctx.connection.filter_state, setter.key(), entry);
            }
        }
        NetworkFlow::CONTINUE
    }
}
