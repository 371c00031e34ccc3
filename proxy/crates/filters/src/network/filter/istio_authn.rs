//! istio-proxy's `istio_authn` network filter (`io.istio.network.authn.Config`): once
//! TLS is up, the first `spiffe://` URI SAN of the peer's certificate becomes the
//! read-only, connection-lived filter state `io.istio.peer_principal`, and the local
//! certificate's `io.istio.local_principal` (what RBAC's `filter_state` principals and
//! Istio's stats read).

use std::sync::Arc;

use envoy_types::pb::google::protobuf::Any;

use crate::network::factory::{CompileCtx, Factory};
use crate::network::{
    NetworkFilter, NetworkFilterConfig, NetworkFlow, NetworkStatus, NewConnection,
};
use shunt_config::{Diagnostics, JsonPath};
use shunt_core::stream_info::{LifeSpan, StringAccessor};

pub const TYPE: &str = "io.istio.network.authn.Config";
pub const PEER_PRINCIPAL: &str = "io.istio.peer_principal";
pub const LOCAL_PRINCIPAL: &str = "io.istio.local_principal";
const SPIFFE_PREFIX: &str = "spiffe://";

pub const FACTORY: Factory = Factory {
    type_name: TYPE,
    compile,
};

#[derive(Debug)]
struct IstioAuthn;

fn compile(
    _any: &Any,
    _ctx: &CompileCtx<'_>,
    _path: &JsonPath,
    _problems: &mut Diagnostics,
) -> Option<Arc<dyn NetworkFilterConfig>> {
    // The config has no fields.
    Some(Arc::new(IstioAuthn))
}

impl NetworkFilterConfig for IstioAuthn {
    fn create(&self) -> Box<dyn NetworkFilter> {
        Box::new(IstioAuthn)
    }
}

impl NetworkFilter for IstioAuthn {
    fn on_new_connection<'a>(&'a mut self, ctx: &'a mut NewConnection<'_>) -> NetworkFlow<'a> {
        let connection = &mut *ctx.connection;
        let Some(tls) = connection.tls.clone() else {
            return NetworkFlow::CONTINUE;
        };
        if !tls.peer_certificate_presented {
            return NetworkFlow::CONTINUE;
        }
        for (key, sans) in [
            (PEER_PRINCIPAL, &tls.peer_uri_sans),
            (LOCAL_PRINCIPAL, &tls.local_uri_sans),
        ] {
            if let Some(principal) = sans.iter().find(|s| s.starts_with(SPIFFE_PREFIX)) {
                let value = Arc::new(StringAccessor(principal.clone()));
                if let Err(err) =
                    connection
                        .filter_state
                        .set(key, value, true, LifeSpan::Connection)
                {
                    tracing::debug!(%err, "istio_authn: principal already set");
                }
            }
        }
        NetworkFlow::Ready(NetworkStatus::Continue)
    }
}
