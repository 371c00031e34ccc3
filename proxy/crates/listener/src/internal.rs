//! The downstream side of internal listeners: a connection an upstream opened in
//! process ([`shunt_upstream::internal`]), what its listener filters read from it
//! (Envoy's `original_dst` on an internal listener reads the passed metadata
//! `envoy.filters.listener.original_dst` `local`, or the shared filter state; Istio's
//! older `istio.set_internal_dst_address` reads `tunnel.destination` and
//! `tunnel.address`), and inspection by reading ahead (there is no MSG_PEEK on a pipe:
//! the bytes read are replayed to the filter chain).

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};

use envoy_types::pb::google::protobuf::value::Kind;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, DuplexStream, ReadBuf};

use shunt_tls::internal_upstream::PassedMetadata;
use shunt_upstream::internal::SharedFilterState;

/// Envoy's `original_dst` metadata namespace and field for internal listeners.
pub const ORIGINAL_DST_NAMESPACE: &str = "envoy.filters.listener.original_dst";
const LOCAL_FIELD: &str = "local";
/// `istio.set_internal_dst_address`'s namespace and fields.
const TUNNEL_NAMESPACE: &str = "tunnel";
const TUNNEL_DESTINATION: &str = "destination";
const TUNNEL_ADDRESS: &str = "address";

/// The string field `field` of namespace `ns`, parsed as `ip:port`.
fn address_in(metadata: &PassedMetadata, ns: &str, field: &str) -> Option<SocketAddr> {
    match metadata.get(ns)?.fields.get(field)?.kind.as_ref()? {
        Kind::StringValue(s) => s.parse().ok(),
        _ => None,
    }
}

/// What `original_dst` restores on an internal connection: the local address (from
/// the metadata, else the filter state) and the remote one (filter state).
pub fn original_dst(
    metadata: &PassedMetadata,
    state: &SharedFilterState,
) -> (Option<SocketAddr>, Option<SocketAddr>) {
    let local = address_in(metadata, ORIGINAL_DST_NAMESPACE, LOCAL_FIELD).or(state.local);
    (local, state.remote)
}

/// What `set_internal_dst_address` restores: the local address and the address an
/// ORIGINAL_DST cluster connects to instead (`tunnel.address`).
pub fn set_internal_dst_address(
    metadata: &PassedMetadata,
    state: &SharedFilterState,
) -> (Option<SocketAddr>, Option<SocketAddr>) {
    if metadata.contains_key(TUNNEL_NAMESPACE) {
        return (
            address_in(metadata, TUNNEL_NAMESPACE, TUNNEL_DESTINATION),
            address_in(metadata, TUNNEL_NAMESPACE, TUNNEL_ADDRESS),
        );
    }
    (state.local, state.local)
}

/// A pipe whose first bytes were read by inspectors and are served again first.
#[derive(Debug)]
pub struct Rewound {
    prefix: Vec<u8>,
    offset: usize,
    inner: DuplexStream,
}

impl Rewound {
    pub fn new(inner: DuplexStream) -> Self {
        Rewound {
            prefix: Vec::new(),
            offset: 0,
            inner,
        }
    }

    /// Reads ahead until `decide` answers, the writer stops (EOF: `decide` sees
    /// `complete`), or `max` bytes are buffered; the bytes stay to be read again.
    pub async fn inspect<T>(
        &mut self,
        max: usize,
        mut decide: impl FnMut(&[u8], bool) -> Option<T>,
    ) -> io::Result<T> {
        loop {
            let buffered = &self.prefix[self.offset..];
            let complete = buffered.len() >= max;
            if let Some(answer) = decide(buffered, complete) {
                return Ok(answer);
            }
            if complete {
                break;
            }
            let mut chunk = vec![0u8; max - buffered.len()];
            let n = self.inner.read(&mut chunk).await?;
            if n == 0 {
                let buffered = &self.prefix[self.offset..];
                if let Some(answer) = decide(buffered, true) {
                    return Ok(answer);
                }
                break;
            }
            self.prefix.extend_from_slice(&chunk[..n]);
        }
        Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "the inspector could not decide",
        ))
    }
}

impl AsyncRead for Rewound {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.offset < this.prefix.len() {
            let rest = &this.prefix[this.offset..];
            let n = rest.len().min(buf.remaining());
            buf.put_slice(&rest[..n]);
            this.offset += n;
            if this.offset == this.prefix.len() {
                this.prefix = Vec::new();
                this.offset = 0;
            }
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut this.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for Rewound {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use envoy_types::pb::google::protobuf::{Struct, Value};
    use tokio::io::AsyncWriteExt;

    fn metadata(ns: &str, fields: &[(&str, &str)]) -> PassedMetadata {
        let mut s = Struct::default();
        for (k, v) in fields {
            s.fields.insert(
                (*k).into(),
                Value {
                    kind: Some(Kind::StringValue((*v).into())),
                },
            );
        }
        [(ns.to_owned(), s)].into()
    }

    #[test]
    fn original_dst_prefers_the_passed_metadata_to_the_filter_state() {
        let state = SharedFilterState {
            local: Some("10.0.0.9:90".parse().unwrap()),
            remote: Some("10.0.0.1:5000".parse().unwrap()),
            objects: Default::default(),
        };
        let passed = metadata(ORIGINAL_DST_NAMESPACE, &[("local", "10.0.0.5:80")]);
        assert_eq!(
            original_dst(&passed, &state),
            (
                Some("10.0.0.5:80".parse().unwrap()),
                Some("10.0.0.1:5000".parse().unwrap())
            )
        );
        assert_eq!(
            original_dst(&PassedMetadata::new(), &state).0,
            Some("10.0.0.9:90".parse().unwrap())
        );
        // Not an address: nothing restored.
        let bad = metadata(ORIGINAL_DST_NAMESPACE, &[("local", "pod.ns")]);
        assert_eq!(
            original_dst(&bad, &SharedFilterState::default()),
            (None, None)
        );
    }

    #[test]
    fn set_internal_dst_address_reads_the_tunnel_namespace() {
        let passed = metadata(
            "tunnel",
            &[
                ("destination", "10.0.0.5:80"),
                ("address", "10.0.0.5:15008"),
            ],
        );
        assert_eq!(
            set_internal_dst_address(&passed, &SharedFilterState::default()),
            (
                Some("10.0.0.5:80".parse().unwrap()),
                Some("10.0.0.5:15008".parse().unwrap())
            )
        );
    }

    #[tokio::test]
    async fn inspected_bytes_are_read_again() {
        let (mut client, server) = tokio::io::duplex(1024);
        let mut rewound = Rewound::new(server);
        client.write_all(b"GET / HTTP/1.1\r\n").await.unwrap();
        let seen = rewound
            .inspect(64, |buf, _| (buf.len() >= 4).then(|| buf[..3].to_vec()))
            .await
            .unwrap();
        assert_eq!(seen, b"GET");
        client.write_all(b"\r\n").await.unwrap();
        drop(client);
        let mut all = Vec::new();
        rewound.read_to_end(&mut all).await.unwrap();
        assert_eq!(all, b"GET / HTTP/1.1\r\n\r\n");
    }
}
