//! istio-proxy's `istio.stats` network filter (`stats.PluginConfig` in a filter chain's
//! `filters`): Istio's TCP metrics for the connection. The labels are fixed once the peer
//! is known (the downstream peer from the listener's metadata exchange on the inbound
//! side, the upstream peer from the cluster's on the outbound side) or at close when it
//! never is: `istio_tcp_connections_opened_total` then, the byte counters and
//! `istio_tcp_connections_closed_total` at close.

use shunt_core::interned::EncodedMetadata;
use std::sync::Arc;

use envoy_types::pb::google::protobuf::Any;

use crate::network::factory::{CompileCtx, Factory};
use crate::network::{
    NetworkFilter, NetworkFilterConfig, NetworkFlow, NetworkStatus, NewConnection,
};
use shunt_config::{Diagnostics, JsonPath};
use shunt_core::istio_stats::expr::NoAttributes;
use shunt_core::istio_stats::labels::{self, ClusterService, Observation};
use shunt_core::istio_stats::{Metric, Recorder, Reporter, Tags};
use shunt_core::peer::filter_state::{self, Side};
use shunt_core::stream_info::{Connection, LifeSpan, UpstreamSlot};

pub const TYPE: &str = "stats.PluginConfig";

pub const FACTORY: Factory = Factory {
    type_name: TYPE,
    compile,
};

#[derive(Debug)]
struct IstioStats {
    recorder: Arc<Recorder>,
}

fn compile(
    any: &Any,
    ctx: &CompileCtx<'_>,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<Arc<dyn NetworkFilterConfig>> {
    let recorder =
        shunt_core::istio_stats::compile(any, ctx.stats, ctx.node, ctx.inbound, path, problems)?;
    Some(Arc::new(IstioStats {
        recorder: Arc::new(recorder),
    }))
}

impl NetworkFilterConfig for IstioStats {
    fn create(&self) -> Box<dyn NetworkFilter> {
        Box::new(Active {
            recorder: self.recorder.clone(),
            opened: None,
        })
    }
}

struct Active {
    recorder: Arc<Recorder>,
    /// The labels, once the open was reported.
    opened: Option<Tags>,
}

impl Active {
    fn client(&self) -> bool {
        self.recorder.config().reporter == Reporter::ClientSidecar
    }

    /// Whether the peer is known (or known to be unknown).
    fn peer_read(&self, connection: &Connection) -> bool {
        if self.client() {
            upstream(connection)
                .is_some_and(|u| filter_state::peer_read(&u.filter_state, Side::Upstream))
        } else {
            filter_state::peer_read(&connection.filter_state, Side::Downstream)
        }
    }

    fn tags(&self, connection: &Connection) -> Tags {
        let upstream = upstream(connection);
        let upstream = upstream.as_deref();
        let peer = if self.client() {
            upstream.and_then(|u| filter_state::peer(&u.filter_state, Side::Upstream))
        } else {
            filter_state::peer(&connection.filter_state, Side::Downstream)
        };
        let (peer_principal, local_principal) = if self.client() {
            let tls = upstream.and_then(|u| u.tls.as_ref());
            (
                tls.and_then(|t| t.peer_uri_sans.first().cloned()),
                tls.and_then(|t| t.local_uri_sans.first().cloned()),
            )
        } else {
            shunt_core::istio_stats::downstream_principals(connection)
        };
        let endpoint = upstream
            .and_then(|u| EncodedMetadata::of(&u.host_metadata))
            .and_then(shunt_core::istio_stats::endpoint_workload);
        let service = upstream
            .and_then(|u| EncodedMetadata::of(&u.cluster_metadata))
            .and_then(shunt_core::istio_stats::cluster_service);
        let obs = Observation {
            peer,
            endpoint: endpoint.as_ref(),
            host: None,
            route_name: None,
            cluster_name: upstream.and_then(|u| u.cluster_name.as_deref()),
            cluster_service: service.as_ref().map(|(host, name)| ClusterService {
                host: Some(host.as_str()),
                name: name.as_deref(),
            }),
            peer_principal: peer_principal.as_deref(),
            local_principal: local_principal.as_deref(),
        };
        // The flags when the labels are fixed: "-" once a peer was read, what
        // tcp_proxy flagged (UF, NC, UH, ...) when the connection closes without one.
        let flags: Vec<&str> = connection
            .filter_state
            .get_as::<UpstreamSlot>(UpstreamSlot::NAME)
            .map(UpstreamSlot::flags)
            .unwrap_or_default()
            .iter()
            .map(|f| f.code())
            .collect();
        let flags = if flags.is_empty() {
            "-".to_owned()
        } else {
            flags.join(",")
        };
        labels::tcp(self.recorder.config(), self.recorder.node(), &obs, &flags)
    }

    fn open(&mut self, connection: &Connection) {
        if self.opened.is_none() {
            let tags = self.tags(connection);
            self.recorder
                .add(Metric::TcpConnectionsOpenedTotal, &tags, &NoAttributes, 1);
            self.opened = Some(tags);
        }
    }
}

fn upstream(connection: &Connection) -> Option<Arc<shunt_core::stream_info::UpstreamInfo>> {
    connection
        .filter_state
        .get_as::<UpstreamSlot>(UpstreamSlot::NAME)?
        .get()
}

impl NetworkFilter for Active {
    fn on_new_connection<'a>(&'a mut self, ctx: &'a mut NewConnection<'_>) -> NetworkFlow<'a> {
        // Ask tcp_proxy for what the upstream side learns (cluster, endpoint, peer).
        if ctx
            .connection
            .filter_state
            .get(UpstreamSlot::NAME)
            .is_none()
        {
            let _ = ctx.connection.filter_state.set(
                UpstreamSlot::NAME,
                Arc::new(UpstreamSlot::default()),
                true,
                LifeSpan::Connection,
            );
        }
        NetworkFlow::Ready(NetworkStatus::Continue)
    }

    fn wants_data(&self) -> bool {
        self.opened.is_none()
    }

    fn on_data(
        &mut self,
        _data: &[u8],
        _end_stream: bool,
        connection: &Connection,
    ) -> NetworkStatus {
        if self.opened.is_none() && self.peer_read(connection) {
            self.open(connection);
        }
        NetworkStatus::Continue
    }

    fn on_close(&mut self, connection: &Connection, received: u64, sent: u64) {
        self.open(connection);
        let Some(tags) = self.opened.take() else {
            return;
        };
        let recorder = &self.recorder;
        recorder.add(Metric::TcpSentBytesTotal, &tags, &NoAttributes, sent);
        recorder.add(
            Metric::TcpReceivedBytesTotal,
            &tags,
            &NoAttributes,
            received,
        );
        recorder.add(Metric::TcpConnectionsClosedTotal, &tags, &NoAttributes, 1);
        recorder.record_custom(&NoAttributes);
    }
}
