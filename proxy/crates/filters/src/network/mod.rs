//! Envoy's network (L4 read) filters: the filters of a filter chain before its
//! terminal one (`tcp_proxy` or the HTTP connection manager).
//!
//! A filter lives for one connection ([`NetworkFilterConfig::create`]) and is called
//! - [`NetworkFilter::on_new_connection`] in chain order before the terminal filter
//!   starts. It may change the connection's [`Connection`] (filter state, metadata),
//!   read the first bytes and consume them, write to the downstream, or close. The
//!   bytes read and not consumed reach the terminal filter.
//! - [`NetworkFilter::on_data`], when [`NetworkFilter::wants_data`], for every read the
//!   terminal filter makes, before it sees the bytes (Envoy's `onData`): RBAC decides
//!   on the first one, as Envoy's does. `Close` ends the connection there.
//! - [`NetworkFilter::on_close`] when the connection is over.
//!
//! Filters are found by config type in [`registry`], like HTTP filters; each lives in
//! [`filter`] (`network/filter/<name>`) and gives the registry a [`factory::Factory`].

pub mod factory;
pub mod filter;
pub mod registry;
pub mod stream;

use std::fmt;
use std::future::Future;
use std::io;
use std::pin::Pin;

use bytes::BytesMut;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use shunt_core::stream_info::Connection;
use shunt_tls::TransportStream;

pub use stream::Filtered;

pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// What a network filter tells the connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NetworkStatus {
    Continue,
    /// Close the connection now (the terminal filter does not see what is left).
    Close,
}

/// A step that is done now or waits (an authorization call, reading a header).
pub enum NetworkFlow<'a> {
    Ready(NetworkStatus),
    Pending(BoxFuture<'a, NetworkStatus>),
}

impl NetworkFlow<'_> {
    pub const CONTINUE: NetworkFlow<'static> = NetworkFlow::Ready(NetworkStatus::Continue);

    pub async fn resolve(self) -> NetworkStatus {
        match self {
            NetworkFlow::Ready(status) => status,
            NetworkFlow::Pending(future) => future.await,
        }
    }
}

/// What `on_new_connection` works with: the connection's facts (mutable) and its
/// downstream bytes.
pub struct NewConnection<'a> {
    pub connection: &'a mut Connection,
    stream: &'a mut TransportStream,
    /// Bytes read and not yet consumed; they go to the terminal filter.
    buffer: &'a mut BytesMut,
}

impl<'a> NewConnection<'a> {
    pub fn new(
        connection: &'a mut Connection,
        stream: &'a mut TransportStream,
        buffer: &'a mut BytesMut,
    ) -> Self {
        NewConnection {
            connection,
            stream,
            buffer,
        }
    }

    /// The bytes read so far and not consumed.
    pub fn buffered(&self) -> &[u8] {
        self.buffer
    }

    /// Reads more from the downstream into the buffer; 0 at its end.
    pub async fn read_more(&mut self) -> io::Result<usize> {
        self.buffer.reserve(16 * 1024);
        self.stream.read_buf(self.buffer).await
    }

    /// Drops the first `n` buffered bytes (a header the filter handled).
    pub fn consume(&mut self, n: usize) {
        let n = n.min(self.buffer.len());
        let _ = self.buffer.split_to(n);
    }

    /// Makes the close that follows a reset (RST), as Envoy's close of a connection
    /// whose bytes it never read.
    pub fn reset_on_close(&self) {
        if let Some(tcp) = self.stream.tcp() {
            shunt_tls::stream::abort(tcp);
        }
    }

    /// Writes to the downstream before anything the terminal filter writes.
    pub async fn write_all(&mut self, data: &[u8]) -> io::Result<()> {
        self.stream.write_all(data).await?;
        self.stream.flush().await
    }
}

/// One network filter on one connection. Every method has Envoy's default: continue.
pub trait NetworkFilter: Send {
    fn on_new_connection<'a>(&'a mut self, _ctx: &'a mut NewConnection<'_>) -> NetworkFlow<'a> {
        NetworkFlow::CONTINUE
    }

    /// Whether [`NetworkFilter::on_data`] must see the terminal filter's reads. When
    /// no filter of a chain does, `tcp_proxy` keeps its socket fast path.
    fn wants_data(&self) -> bool {
        false
    }

    /// Bytes read from the downstream, before the terminal filter gets them;
    /// `end_stream` at the downstream's end.
    fn on_data(
        &mut self,
        _data: &[u8],
        _end_stream: bool,
        _connection: &Connection,
    ) -> NetworkStatus {
        NetworkStatus::Continue
    }

    /// The connection is over: bytes from (`received`) and to (`sent`) the downstream.
    fn on_close(&mut self, _connection: &Connection, _received: u64, _sent: u64) {}
}

/// A network filter as compiled from its config; makes one [`NetworkFilter`] per
/// connection.
pub trait NetworkFilterConfig: fmt::Debug + Send + Sync {
    fn create(&self) -> Box<dyn NetworkFilter>;
}

/// The network filters of one filter chain, in order, terminal filter excluded.
#[derive(Debug, Default)]
pub struct NetworkFilters {
    pub filters: Vec<(String, std::sync::Arc<dyn NetworkFilterConfig>)>,
}

impl NetworkFilters {
    pub fn is_empty(&self) -> bool {
        self.filters.is_empty()
    }

    /// Creates the filters for one connection and runs `on_new_connection` on each in
    /// order. `None`: a filter closed the connection; the filters are told.
    pub async fn start(
        &self,
        connection: &mut Connection,
        stream: &mut TransportStream,
        buffer: &mut BytesMut,
    ) -> Option<Vec<Box<dyn NetworkFilter>>> {
        let mut active: Vec<Box<dyn NetworkFilter>> =
            self.filters.iter().map(|(_, f)| f.create()).collect();
        for i in 0..active.len() {
            let mut ctx = NewConnection::new(connection, stream, buffer);
            let status = active[i].on_new_connection(&mut ctx).resolve().await;
            if status == NetworkStatus::Close {
                tracing::debug!(filter = %self.filters[i].0, "network filter closed the connection");
                for filter in &mut active {
                    filter.on_close(connection, 0, 0);
                }
                return None;
            }
        }
        Some(active)
    }
}
