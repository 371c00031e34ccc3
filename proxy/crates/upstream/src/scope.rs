//! Where a connection's upstreams are made: the task-locals a proxy instance sets on
//! each of its connections (a pod's network namespace, [`super::netns`]; its same-node
//! client, [`super::same_node`]; the instance's internal listeners,
//! [`super::internal`]). Task-locals do not follow `tokio::spawn`, so what a connection
//! spawns that may connect upstream (HTTP/2 streams) runs through [`ScopedExecutor`],
//! which sets them again.

use std::future::Future;
use std::os::fd::OwnedFd;
use std::sync::Arc;

use tokio_util::either::Either;

use super::internal::Acceptor;
use super::same_node::Client;

/// The task-locals of one connection.
#[derive(Clone, Default)]
pub struct ConnectionScope {
    pub netns: Option<Arc<OwnedFd>>,
    pub same_node: Option<Arc<Client>>,
    pub internal: Option<Arc<dyn Acceptor>>,
}

impl ConnectionScope {
    /// The current task's.
    pub fn current() -> Self {
        ConnectionScope {
            netns: super::netns::current(),
            same_node: super::same_node::current(),
            internal: super::internal::current(),
        }
    }

    fn is_empty(&self) -> bool {
        self.netns.is_none() && self.same_node.is_none() && self.internal.is_none()
    }

    /// Runs `f` with these task-locals. Built from `Either`s, not nested `async`
    /// blocks: each of those would hold `f` twice (captured, and inside its scope), so
    /// three layers made the spawned future ~27 times `f` (an HTTP/2 stream's, copied
    /// whole on every spawn and completion).
    pub fn run<F: Future>(self, f: F) -> impl Future<Output = F::Output> {
        let ConnectionScope {
            netns,
            same_node,
            internal,
        } = self;
        let f = match same_node {
            Some(client) => Either::Left(super::same_node::scope(client, f)),
            None => Either::Right(f),
        };
        let f = match internal {
            Some(registry) => Either::Left(super::internal::scope(registry, f)),
            None => Either::Right(f),
        };
        match netns {
            Some(netns) => Either::Left(super::netns::scope(netns, f)),
            None => Either::Right(f),
        }
    }
}

/// hyper's executor for what a connection spawns (its HTTP/2 streams): in the
/// connection's scope, taken when the executor is made.
#[derive(Clone, Default)]
pub struct ScopedExecutor(ConnectionScope);

impl ScopedExecutor {
    /// An executor that spawns in the current task's scope.
    pub fn current() -> Self {
        ScopedExecutor(ConnectionScope::current())
    }
}

impl<F> hyper::rt::Executor<F> for ScopedExecutor
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    fn execute(&self, fut: F) {
        if self.0.is_empty() {
            tokio::spawn(fut);
        } else {
            tokio::spawn(self.0.clone().run(fut));
        }
    }
}
