//! xDS servers in this process. `shunt agent` runs the proxy in its own process; its SDS
//! server and xDS proxy register here under the Unix socket paths the bootstrap's
//! `sds-grpc` and `xds-grpc` clusters name, and a stream to such a path is opened by a
//! call instead of a connect: the same requests and responses, no socket, no gRPC
//! framing, nothing bound at that path.

use std::collections::HashMap;
use std::path::{Component, Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;

use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
};
use tokio_stream::Stream;

use super::source::Target;

/// A stream of messages, ended by an error status or by its end.
pub type MessageStream<T> = Pin<Box<dyn Stream<Item = Result<T, tonic::Status>> + Send>>;

/// An xDS server reached by a call. `method` is the gRPC method the stream would use
/// (`.../StreamSecrets`, `.../StreamAggregatedResources`, ...).
#[tonic::async_trait]
pub trait LocalServer: Send + Sync {
    async fn sotw(
        &self,
        method: &'static str,
        requests: MessageStream<DiscoveryRequest>,
    ) -> Result<MessageStream<DiscoveryResponse>, tonic::Status>;

    async fn delta(
        &self,
        method: &'static str,
        requests: MessageStream<DeltaDiscoveryRequest>,
    ) -> Result<MessageStream<DeltaDiscoveryResponse>, tonic::Status>;
}

/// The in-process servers, by socket path (`./a/b` and `a/b` are the same path).
#[derive(Clone, Default)]
pub struct LocalServers(HashMap<PathBuf, Arc<dyn LocalServer>>);

impl std::fmt::Debug for LocalServers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_set().entries(self.0.keys()).finish()
    }
}

impl LocalServers {
    pub fn insert(&mut self, path: &Path, server: Arc<dyn LocalServer>) {
        self.0.insert(normal(path), server);
    }

    /// The server a stream to `target` reaches in this process, if any.
    pub fn get(&self, target: &Target) -> Option<Arc<dyn LocalServer>> {
        match target {
            Target::Unix(path) => self.0.get(&normal(path)).cloned(),
            Target::Tcp(_) => None,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

fn normal(path: &Path) -> PathBuf {
    path.components()
        .filter(|c| !matches!(c, Component::CurDir))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Nothing;

    #[tonic::async_trait]
    impl LocalServer for Nothing {
        async fn sotw(
            &self,
            _: &'static str,
            _: MessageStream<DiscoveryRequest>,
        ) -> Result<MessageStream<DiscoveryResponse>, tonic::Status> {
            Err(tonic::Status::unimplemented("none"))
        }
        async fn delta(
            &self,
            _: &'static str,
            _: MessageStream<DeltaDiscoveryRequest>,
        ) -> Result<MessageStream<DeltaDiscoveryResponse>, tonic::Status> {
            Err(tonic::Status::unimplemented("none"))
        }
    }

    #[test]
    fn a_socket_path_finds_its_server_however_it_is_spelled() {
        let mut local = LocalServers::default();
        local.insert(Path::new("./etc/istio/proxy/XDS"), Arc::new(Nothing));
        assert!(
            local
                .get(&Target::Unix("etc/istio/proxy/XDS".into()))
                .is_some()
        );
        assert!(
            local
                .get(&Target::Unix("./etc/istio/proxy/XDS".into()))
                .is_some()
        );
        assert!(
            local
                .get(&Target::Unix("/etc/istio/proxy/XDS".into()))
                .is_none()
        );
        assert!(
            local
                .get(&Target::Tcp("127.0.0.1:1".parse().unwrap()))
                .is_none()
        );
    }
}
