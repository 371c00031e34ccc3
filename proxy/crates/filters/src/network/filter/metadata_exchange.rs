//! istio-proxy's TCP metadata exchange filter on a listener
//! (`envoy.tcp.metadataexchange.config.MetadataExchange`, Istio's `istio.metadata_exchange`):
//! when the downstream TLS session negotiated the exchange's ALPN protocol
//! (`istio-peer-exchange`), the first bytes the client sends are its exchange header
//! ([`shunt_core::peer::exchange`]). Once they start arriving this side answers with its own,
//! reads the peer's header off the stream and records the peer as
//! `wasm.downstream_peer` / `wasm.downstream_peer_id` for the filters after it (stats,
//! RBAC); the payload after the header goes on untouched. Any other ALPN, or bytes that
//! are not a header, leave the peer unknown and the bytes as they are.

use std::sync::Arc;

use envoy_types::pb::google::protobuf::Any;

use crate::network::factory::{CompileCtx, Factory};
use crate::network::{
    NetworkFilter, NetworkFilterConfig, NetworkFlow, NetworkStatus, NewConnection,
};
use shunt_config::{Diagnostics, JsonPath};
use shunt_core::peer::exchange::{self, Decoded};
use shunt_core::peer::filter_state::{self, Side};
use shunt_core::stats::Counter;
use shunt_core::stream_info::LifeSpan;

pub const TYPE: &str = "envoy.tcp.metadataexchange.config.MetadataExchange";

pub const FACTORY: Factory = Factory {
    type_name: TYPE,
    compile,
};

/// The fields of the config shunt reads.
#[derive(Clone, PartialEq, prost::Message)]
struct Config {
    #[prost(string, tag = "1")]
    protocol: String,
}

#[derive(Debug)]
struct MetadataExchange {
    protocol: String,
    /// The bytes written first: fixed for the node.
    header: Arc<[u8]>,
    stats: Arc<Stats>,
}

/// istio-proxy's `metadata_exchange.*` counters.
#[derive(Debug)]
struct Stats {
    alpn_protocol_found: Counter,
    alpn_protocol_not_found: Counter,
    initial_header_not_found: Counter,
    header_not_found: Counter,
    metadata_added: Counter,
}

fn compile(
    any: &Any,
    ctx: &CompileCtx<'_>,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<Arc<dyn NetworkFilterConfig>> {
    let config = match <Config as prost::Message>::decode(any.value.as_slice()) {
        Ok(config) => config,
        Err(err) => {
            problems.error(path, format!("cannot decode {TYPE}: {err}"));
            return None;
        }
    };
    let protocol = if config.protocol.is_empty() {
        exchange::PROTOCOL.to_owned()
    } else {
        config.protocol
    };
    let counter = |name: &str| ctx.stats.counter(&format!("metadata_exchange.{name}"));
    Some(Arc::new(MetadataExchange {
        protocol,
        header: exchange::encode(ctx.node).into(),
        stats: Arc::new(Stats {
            alpn_protocol_found: counter("alpn_protocol_found"),
            alpn_protocol_not_found: counter("alpn_protocol_not_found"),
            initial_header_not_found: counter("initial_header_not_found"),
            header_not_found: counter("header_not_found"),
            metadata_added: counter("metadata_added"),
        }),
    }))
}

impl NetworkFilterConfig for MetadataExchange {
    fn create(&self) -> Box<dyn NetworkFilter> {
        Box::new(Active {
            protocol: self.protocol.clone(),
            header: self.header.clone(),
            stats: self.stats.clone(),
        })
    }
}

struct Active {
    protocol: String,
    header: Arc<[u8]>,
    stats: Arc<Stats>,
}

impl NetworkFilter for Active {
    fn on_new_connection<'a>(&'a mut self, ctx: &'a mut NewConnection<'_>) -> NetworkFlow<'a> {
        if ctx.connection.alpn.as_deref() != Some(self.protocol.as_str()) {
            self.stats.alpn_protocol_not_found.inc();
            filter_state::set_unknown(
                &mut ctx.connection.filter_state,
                Side::Downstream,
                LifeSpan::Connection,
            );
            return NetworkFlow::CONTINUE;
        }
        self.stats.alpn_protocol_found.inc();
        NetworkFlow::Pending(Box::pin(async move {
            // istio-proxy answers on the client's first bytes.
            while ctx.buffered().is_empty() {
                match ctx.read_more().await {
                    Ok(0) | Err(_) => return NetworkStatus::Close,
                    Ok(_) => {}
                }
            }
            if ctx.write_all(&self.header).await.is_err() {
                return NetworkStatus::Close;
            }
            self.stats.metadata_added.inc();
            loop {
                match exchange::decode(ctx.buffered()) {
                    Ok(Decoded::NeedMore { .. }) => match ctx.read_more().await {
                        Ok(0) | Err(_) => return NetworkStatus::Close,
                        Ok(_) => {}
                    },
                    Ok(Decoded::Done { peer, consumed }) => {
                        ctx.consume(consumed);
                        let workload = peer.metadata.unwrap_or_default().workload();
                        filter_state::set_peer(
                            &mut ctx.connection.filter_state,
                            Side::Downstream,
                            workload,
                            peer.id.as_deref().unwrap_or_default(),
                            LifeSpan::Connection,
                        );
                        return NetworkStatus::Continue;
                    }
                    Err(err) => {
                        tracing::debug!(%err, "metadata exchange: no peer header");
                        match err {
                            exchange::ExchangeError::BadMagic { .. } => {
                                self.stats.initial_header_not_found.inc()
                            }
                            _ => self.stats.header_not_found.inc(),
                        }
                        filter_state::set_unknown(
                            &mut ctx.connection.filter_state,
                            Side::Downstream,
                            LifeSpan::Connection,
                        );
                        return NetworkStatus::Continue;
                    }
                }
            }
        }))
    }
}
