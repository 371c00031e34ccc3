//! `cargo xtask bench http --mtls`: the sidecar pair's two bootstraps (issue 15).
//!
//! The client pod's sidecar takes plain HTTP on 127.0.0.1:10000 through the bench's
//! six-virtual-host route table, and sends to the server pod's sidecar over mutual TLS
//! and HTTP/2 (Istio speaks h2 between sidecars for HTTP). The server sidecar requires
//! the client's certificate, checks its SPIFFE identity, and routes to the app (nginx on
//! 127.0.0.1:8080 in its pod). Certificates come from an Istio-like CA made with openssl
//! once per run (the soak bench's [`Tls`]); the bootstraps name the files, so shunt and
//! Envoy run the same two files.

use std::net::SocketAddr;
use std::path::Path;

use anyhow::Result;

use super::soak::config::Tls;

/// The server sidecar's mTLS port (Istio's inbound capture port is 15006; this pair is
/// addressed explicitly, like an east-west gateway's 15443).
pub(crate) const MTLS_PORT: u16 = 15443;
/// The app in the server pod, as its sidecar reaches it.
pub(crate) const APP: &str = "127.0.0.1";
pub(crate) const SERVER_IDENTITY: &str = "spiffe://cluster.local/ns/default/sa/server";
/// What the server sidecar accepts: any workload of the trust domain, as Istio's
/// inbound does in PERMISSIVE/STRICT without an AuthorizationPolicy.
const TRUST_DOMAIN_PREFIX: &str = "spiffe://cluster.local/";

/// The CA, the two identities and their files, made with openssl in `dir`.
pub(crate) fn pki(dir: &Path) -> Result<Tls> {
    Tls::new(dir)
}

/// The client sidecar: `route_table` (the bench's plain bootstrap, its cluster pointed
/// at the server sidecar) with TLS (client certificate, CA and SAN checked, SNI, ALPN
/// h2) and HTTP/2 on the upstream cluster.
pub(crate) fn client_bootstrap(route_table: &str, tls: &Tls) -> String {
    let cluster_tls = format!(
        r#"    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config:
          http2_protocol_options: {{}}
    transport_socket:
      name: envoy.transport_sockets.tls
      typed_config:
        "@type": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext
        sni: {sni}
        common_tls_context:
          alpn_protocols: [h2]
          tls_certificates:
          - certificate_chain: {{ filename: {chain} }}
            private_key: {{ filename: {key} }}
          validation_context:
            trusted_ca: {{ filename: {ca} }}
            match_typed_subject_alt_names:
            - san_type: URI
              matcher: {{ exact: "{SERVER_IDENTITY}" }}
"#,
        sni = super::soak::config::SERVER_NAME,
        chain = tls.file("client.pem"),
        key = tls.file("client.key"),
        ca = tls.file("ca.pem"),
    );
    route_table
        .replacen(
            "# Written by `cargo xtask bench http`; shunt and Envoy both run this file.",
            "# Written by `cargo xtask bench http --mtls`: the client sidecar (shunt and Envoy both run this file).",
            1,
        )
        .replacen(
            "    lb_policy: ROUND_ROBIN\n",
            &format!("    lb_policy: ROUND_ROBIN\n{cluster_tls}"),
            1,
        )
}

/// The server sidecar: mTLS on `listen` (client certificate required, its SPIFFE
/// identity in the trust domain, ALPN h2 or http/1.1), one catch-all route to the app.
pub(crate) fn server_bootstrap(
    listen: SocketAddr,
    app_port: u16,
    admin_port: u16,
    tls: &Tls,
) -> String {
    let (ip, port) = (listen.ip(), listen.port());
    format!(
        r#"# Written by `cargo xtask bench http --mtls`: the server sidecar (shunt and Envoy both run this file).
admin:
  address:
    socket_address: {{ address: 127.0.0.1, port_value: {admin_port} }}
static_resources:
  listeners:
  - name: inbound
    address:
      socket_address: {{ address: {ip}, port_value: {port} }}
    filter_chains:
    - transport_socket:
        name: envoy.transport_sockets.tls
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext
          require_client_certificate: true
          common_tls_context:
            alpn_protocols: [h2, http/1.1]
            tls_certificates:
            - certificate_chain: {{ filename: {chain} }}
              private_key: {{ filename: {key} }}
            validation_context:
              trusted_ca: {{ filename: {ca} }}
              match_typed_subject_alt_names:
              - san_type: URI
                matcher: {{ prefix: "{TRUST_DOMAIN_PREFIX}" }}
      filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: inbound
          codec_type: AUTO
          http_filters:
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
          route_config:
            name: inbound
            virtual_hosts:
            - name: inbound
              domains: ["*"]
              routes:
              - match: {{ prefix: "/" }}
                route: {{ cluster: app, timeout: 5s }}
  clusters:
  - name: app
    type: STATIC
    connect_timeout: 1s
    lb_policy: ROUND_ROBIN
    load_assignment:
      cluster_name: app
      endpoints:
      - lb_endpoints:
        - endpoint:
            address:
              socket_address: {{ address: {APP}, port_value: {app_port} }}
"#,
        chain = tls.file("server.pem"),
        key = tls.file("server.key"),
        ca = tls.file("ca.pem"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The soak CA's client identity, which the server sidecar must accept.
    const CLIENT_IDENTITY: &str = "spiffe://cluster.local/ns/default/sa/client";

    fn san(pem: &Path) -> String {
        let out = std::process::Command::new("openssl")
            .args(["x509", "-noout", "-ext", "subjectAltName", "-in"])
            .arg(pem)
            .output()
            .expect("openssl x509");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    #[test]
    fn the_pair_speaks_mtls_and_h2_with_the_identities_the_ca_issued() {
        let dir = std::env::temp_dir().join(format!("shunt-http-mtls-{}", std::process::id()));
        let tls = pki(&dir).unwrap();
        let route_table = super::super::http::bootstrap_for_tests();
        let client = client_bootstrap(&route_table, &tls);
        // The route table is kept; TLS and h2 go on its one cluster.
        assert_eq!(client.matches("- name: svc").count(), 6);
        assert_eq!(client.matches("UpstreamTlsContext").count(), 1);
        let cluster = client.find("  - name: upstream").expect("the cluster");
        assert!(client.find("UpstreamTlsContext").unwrap() > cluster);
        assert!(client.contains("http2_protocol_options: {}"));
        assert!(client.contains("alpn_protocols: [h2]"));
        let server = server_bootstrap(
            SocketAddr::from(([10, 0, 0, 3], MTLS_PORT)),
            8080,
            15000,
            &tls,
        );
        assert!(server.contains("require_client_certificate: true"));
        assert!(server.contains(&format!("address: {APP}, port_value: 8080")));
        // Every file either names exists, and the certificates carry the SANs matched.
        for yaml in [&client, &server] {
            for line in yaml.lines().filter(|l| l.contains("filename:")) {
                let file = line
                    .split("filename: ")
                    .nth(1)
                    .unwrap()
                    .trim_end_matches([' ', '}']);
                assert!(Path::new(file).is_file(), "{file} of {line:?}");
            }
        }
        assert!(san(&dir.join("server.pem")).contains(SERVER_IDENTITY));
        assert!(san(&dir.join("client.pem")).contains(CLIENT_IDENTITY));
        assert!(CLIENT_IDENTITY.starts_with(TRUST_DOMAIN_PREFIX));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
