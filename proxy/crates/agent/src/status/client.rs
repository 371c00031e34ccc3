//! The status server's one-request HTTP/1.1 client: to the proxy's admin API (ready,
//! stats, drain), the app's metrics, and the app's probes (from a chosen source
//! address, over TLS without verification for `scheme: HTTPS`, as the kubelet does).

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Limited};
use hyper::{HeaderMap, Method, Request, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpSocket, TcpStream};

/// One request to send.
pub struct Call<'a> {
    pub method: Method,
    pub to: SocketAddr,
    /// Source address to connect from (`127.0.0.6` for app probes).
    pub from: Option<IpAddr>,
    pub tls: bool,
    pub path_and_query: &'a str,
    /// The `Host` header; `to` when `None`.
    pub host: Option<&'a str>,
    pub headers: HeaderMap,
    /// For the whole exchange: connect, request, answer.
    pub timeout: Duration,
    /// Bodies longer than this are an error.
    pub max_body: usize,
}

pub struct Answer {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Call<'_> {
    pub fn get(to: SocketAddr, path_and_query: &str, timeout: Duration) -> Call<'_> {
        Call {
            method: Method::GET,
            to,
            from: None,
            tls: false,
            path_and_query,
            host: None,
            headers: HeaderMap::new(),
            timeout,
            max_body: 64 << 20,
        }
    }

    pub async fn send(self) -> anyhow::Result<Answer> {
        let what = format!("{} {}{}", self.method, self.to, self.path_and_query);
        match tokio::time::timeout(self.timeout, self.exchange()).await {
            Ok(Ok(answer)) => Ok(answer),
            Ok(Err(err)) => Err(err.context(what)),
            Err(_) => anyhow::bail!("{what}: no answer within {:?}", self.timeout),
        }
    }

    async fn exchange(&self) -> anyhow::Result<Answer> {
        let stream = connect(self.to, self.from).await?;
        if self.tls {
            let name = rustls::pki_types::ServerName::IpAddress(self.to.ip().into());
            let tls = tokio_rustls::TlsConnector::from(insecure_tls())
                .connect(name, stream)
                .await?;
            self.over(tls).await
        } else {
            self.over(stream).await
        }
    }

    async fn over<S>(&self, stream: S) -> anyhow::Result<Answer>
    where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let (mut sender, connection) =
            hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
        let connection = tokio::spawn(connection);
        let host = match self.host {
            Some(host) => host.to_owned(),
            None => self.to.to_string(),
        };
        let mut request = Request::builder()
            .method(self.method.clone())
            .uri(self.path_and_query)
            .body(Empty::<Bytes>::new())?;
        *request.headers_mut() = self.headers.clone();
        request
            .headers_mut()
            .insert(hyper::header::HOST, host.parse()?);
        let response = sender.send_request(request).await?;
        let (parts, body) = response.into_parts();
        let body = Limited::new(body, self.max_body)
            .collect()
            .await
            .map_err(|err| anyhow::anyhow!("reading the body: {err}"))?
            .to_bytes();
        connection.abort();
        Ok(Answer {
            status: parts.status,
            headers: parts.headers,
            body,
        })
    }
}

/// A TCP connection to `to`, from `from` when given.
pub async fn connect(to: SocketAddr, from: Option<IpAddr>) -> std::io::Result<TcpStream> {
    let socket = match to {
        SocketAddr::V4(_) => TcpSocket::new_v4()?,
        SocketAddr::V6(_) => TcpSocket::new_v6()?,
    };
    if let Some(from) = from {
        socket.bind(SocketAddr::new(from, 0))?;
    }
    socket.connect(to).await
}

/// Kubernetes' HTTPS probes do not verify the app's certificate; neither does this.
fn insecure_tls() -> Arc<rustls::ClientConfig> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .expect("ring supports the default protocol versions")
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(AnyCertificate(provider)))
        .with_no_client_auth();
    Arc::new(config)
}

#[derive(Debug)]
struct AnyCertificate(Arc<rustls::crypto::CryptoProvider>);

impl rustls::client::danger::ServerCertVerifier for AnyCertificate {
    fn verify_server_cert(
        &self,
        _: &rustls::pki_types::CertificateDer<'_>,
        _: &[rustls::pki_types::CertificateDer<'_>],
        _: &rustls::pki_types::ServerName<'_>,
        _: &[u8],
        _: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        Ok(rustls::client::danger::ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}
