//! TLS with real certificates made by the `openssl` CLI at test time: a CA, a server
//! certificate with DNS, SPIFFE URI and IP SANs, a client certificate, and a second CA
//! nobody trusts. Handshakes run in process over loopback TCP.

use std::sync::Arc;

use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::{
    DownstreamTlsContext, Secret as EnvoySecret, UpstreamTlsContext,
};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::san::{self, San};
use super::secret::{self, SecretKind};
use super::testing::Pki;
use super::{DownstreamTls, HandshakeError, Secrets, UpstreamTls};
use shunt_config::{Diagnostics, JsonPath};

fn secret(json: serde_json::Value) -> (Option<secret::Secret>, Diagnostics) {
    let message: EnvoySecret = shunt_config::message_from_json(json).unwrap();
    let mut problems = Diagnostics::default();
    let compiled = secret::compile(
        &message,
        &JsonPath::new("static_resources.secrets[0]"),
        &mut problems,
    );
    (compiled, problems)
}

fn errors(problems: &Diagnostics) -> Vec<(String, String)> {
    problems
        .errors
        .iter()
        .map(|p| (p.path.clone(), p.message.clone()))
        .collect()
}

/// The errors of a secret that must not compile: (path, message).
fn refused(json: serde_json::Value) -> Vec<(String, String)> {
    let (compiled, problems) = secret(json);
    assert!(
        compiled.is_none(),
        "compiled despite {:?}",
        errors(&problems)
    );
    errors(&problems)
}

#[test]
fn secret_errors_name_the_json_path_and_what_is_wrong() {
    let pki = Pki::new();
    let at = "static_resources.secrets[0].tls_certificate";

    let found = refused(json!({"name": "default", "tls_certificate": {
        "certificate_chain": {"filename": "/nonexistent/cert.pem"},
        "private_key": {"filename": pki.path("server.key")}}}));
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!(found[0].0, format!("{at}.certificate_chain.filename"));
    assert!(
        found[0].1.starts_with("reading /nonexistent/cert.pem: "),
        "{}",
        found[0].1
    );

    // The certificate given as the key: no key block in it.
    let found = refused(json!({"name": "default", "tls_certificate": {
        "certificate_chain": {"filename": pki.path("server.pem")},
        "private_key": {"filename": pki.path("server.pem")}}}));
    assert_eq!(
        found,
        [(
            format!("{at}.private_key"),
            "no PEM PRIVATE KEY block (PKCS#8, RSA or EC)".to_owned()
        )]
    );

    // Another certificate's key.
    let found = refused(json!({"name": "default", "tls_certificate": {
        "certificate_chain": {"filename": pki.path("server.pem")},
        "private_key": {"inline_string": pki.read("client.key")}}}));
    assert_eq!(
        found,
        [(
            format!("{at}.private_key"),
            "does not match the public key of the certificate_chain's first certificate".to_owned()
        )]
    );

    let found = refused(json!({"name": "rootca", "validation_context": {
        "trusted_ca": {"inline_string": "not PEM"},
        "match_typed_subject_alt_names": [{"san_type": "URI", "matcher": {"safe_regex": {"regex": "spiffe://(unclosed"}}}]}}));
    let at = "static_resources.secrets[0].validation_context";
    assert_eq!(found[0].0, format!("{at}.trusted_ca"));
    assert_eq!(found[0].1, "no PEM CERTIFICATE block");
    assert_eq!(
        found[1].0,
        format!("{at}.match_typed_subject_alt_names[0].matcher.safe_regex.regex")
    );

    let found = refused(json!({"name": "x", "tls_certificate": {
        "certificate_chain": {"environment_variable": "SHUNT_TEST_SURELY_UNSET"},
        "private_key": {"filename": pki.path("server.key")}}}));
    assert_eq!(
        found,
        [(
            "static_resources.secrets[0].tls_certificate.certificate_chain.environment_variable"
                .to_owned(),
            "SHUNT_TEST_SURELY_UNSET is not set".to_owned()
        )]
    );
}

#[test]
fn secrets_from_files_inline_and_static_lists_compile() {
    let pki = Pki::new();
    let (cert, problems) = secret(json!({"name": "default", "tls_certificate": {
        "certificate_chain": {"filename": pki.path("server.pem")},
        "private_key": {"inline_bytes": base64(pki.read("server.key").as_bytes())}}}));
    assert!(problems.errors.is_empty(), "{:?}", problems.errors);
    match cert.unwrap().kind {
        SecretKind::TlsCertificate(cert) => assert_eq!(cert.key.cert.len(), 1),
        other => panic!("{other:?}"),
    }

    let secrets: Vec<EnvoySecret> = [
        json!({"name": "ROOTCA", "validation_context": {"trusted_ca": {"filename": pki.path("ca.pem")}}}),
        json!({"name": "ROOTCA", "validation_context": {"trusted_ca": {"filename": pki.path("ca.pem")}}}),
    ]
    .into_iter()
    .map(|j| shunt_config::message_from_json(j).unwrap())
    .collect();
    let mut problems = Diagnostics::default();
    let compiled = secret::compile_static(&secrets, &mut problems);
    assert_eq!(compiled.len(), 1);
    assert_eq!(
        errors(&problems),
        [(
            "static_resources.secrets[1].name".to_owned(),
            "secret \"ROOTCA\" is defined twice".to_owned()
        )]
    );
}

/// Standard base64, for `inline_bytes` in proto3 JSON.
fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ALPHABET[(n >> (18 - 6 * i)) as usize & 63] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[test]
fn the_sans_of_a_certificate_are_read_from_its_der() {
    let pki = Pki::new();
    let der = super::pem::certificates(pki.read("server.pem").as_bytes()).unwrap();
    assert_eq!(
        san::of_certificate(&der[0]),
        [
            San::Dns("server.test".into()),
            San::Uri("spiffe://cluster.local/ns/default/sa/server".into()),
            San::Ip("127.0.0.1".parse().unwrap()),
        ]
    );
    // A CA made without SANs has none.
    let ca = super::pem::certificates(pki.read("ca.pem").as_bytes()).unwrap();
    assert!(san::of_certificate(&ca[0]).is_empty());
}

fn matcher(json: serde_json::Value) -> san::SanMatcher {
    let m = shunt_config::message_from_json(json).unwrap();
    let mut problems = Diagnostics::default();
    san::SanMatcher::compile_typed(&m, &JsonPath::new("m"), &mut problems).expect("compiles")
}

#[test]
fn san_matchers_compare_by_type_and_pattern() {
    let spiffe = San::Uri("spiffe://cluster.local/ns/default/sa/server".into());
    let dns = San::Dns("server.test".into());
    let ip = San::Ip("10.0.0.1".parse().unwrap());
    let uri_prefix = matcher(
        json!({"san_type": "URI", "matcher": {"prefix": "spiffe://cluster.local/ns/default/"}}),
    );
    assert!(uri_prefix.matches(&spiffe));
    // Same text, other type: no.
    assert!(!uri_prefix.matches(&San::Dns("spiffe://cluster.local/ns/default/sa/x".into())));
    assert!(matcher(json!({"san_type": "DNS", "matcher": {"suffix": ".test"}})).matches(&dns));
    assert!(
        matcher(
            json!({"san_type": "DNS", "matcher": {"exact": "SERVER.test", "ignore_case": true}})
        )
        .matches(&dns)
    );
    assert!(
        !matcher(json!({"san_type": "DNS", "matcher": {"exact": "SERVER.test"}})).matches(&dns)
    );
    assert!(
        matcher(json!({"san_type": "IP_ADDRESS", "matcher": {"exact": "10.0.0.1"}})).matches(&ip)
    );
    assert!(matcher(json!({"san_type": "URI", "matcher": {"contains": "/sa/"}})).matches(&spiffe));
    let regex = matcher(
        json!({"san_type": "URI", "matcher": {"safe_regex": {"regex": "spiffe://cluster\\.local/ns/[a-z]+/sa/server"}}}),
    );
    assert!(regex.matches(&spiffe));
    // safe_regex matches the whole SAN, not a part of it.
    assert!(!regex.matches(&San::Uri(
        "spiffe://cluster.local/ns/default/sa/server2".into()
    )));
    // A wildcard certificate SAN covers exactly one label.
    let wildcard = San::Dns("*.example.com".into());
    let exact = |name: &str| matcher(json!({"san_type": "DNS", "matcher": {"exact": name}}));
    assert!(exact("api.example.com").matches(&wildcard));
    assert!(!exact("a.b.example.com").matches(&wildcard));
    assert!(!exact("example.com").matches(&wildcard));
    // No matchers: any certificate; some: any one must match.
    assert!(san::accepts(&[], &[]));
    assert!(san::accepts(
        std::slice::from_ref(&uri_prefix),
        &[dns.clone(), spiffe]
    ));
    assert!(!san::accepts(&[uri_prefix], &[dns]));
}

fn downstream(json: serde_json::Value) -> Result<DownstreamTls, Vec<(String, String)>> {
    let context: DownstreamTlsContext = shunt_config::message_from_json(json).unwrap();
    let mut problems = Diagnostics::default();
    DownstreamTls::compile(&context, &JsonPath::new("ts"), &mut problems)
        .ok_or_else(|| errors(&problems))
}

fn upstream(json: serde_json::Value) -> Result<UpstreamTls, Vec<(String, String)>> {
    let context: UpstreamTlsContext = shunt_config::message_from_json(json).unwrap();
    let mut problems = Diagnostics::default();
    UpstreamTls::compile(&context, &JsonPath::new("ts"), &mut problems)
        .ok_or_else(|| errors(&problems))
}

fn certificate(pki: &Pki, name: &str) -> serde_json::Value {
    json!({"certificate_chain": {"filename": pki.path(&format!("{name}.pem"))},
           "private_key": {"filename": pki.path(&format!("{name}.key"))}})
}

fn static_secrets(pki: &Pki, entries: &[(&str, serde_json::Value)]) -> Secrets {
    let _ = pki;
    let secrets: Vec<EnvoySecret> = entries
        .iter()
        .map(|(name, body)| {
            let mut j = body.clone();
            j["name"] = json!(name);
            shunt_config::message_from_json(j).unwrap()
        })
        .collect();
    let mut problems = Diagnostics::default();
    let compiled = secret::compile_static(&secrets, &mut problems);
    assert!(problems.errors.is_empty(), "{:?}", problems.errors);
    compiled
}

/// One handshake through loopback: the client's result, and the server's.
async fn handshake(
    server: &DownstreamTls,
    server_secrets: &Secrets,
    client: &UpstreamTls,
    client_secrets: &Secrets,
) -> (Result<(), String>, Result<(), String>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let serve = async {
        let (tcp, _) = listener.accept().await.unwrap();
        let mut tls = server
            .accept(tcp, server_secrets)
            .await
            .map_err(|e| e.to_string())?;
        let mut buf = [0u8; 4];
        tls.read_exact(&mut buf).await.map_err(|e| e.to_string())?;
        tls.write_all(&buf).await.map_err(|e| e.to_string())?;
        tls.shutdown().await.map_err(|e| e.to_string())
    };
    let call = async {
        let tcp = TcpStream::connect(addr).await.unwrap();
        let mut tls = client
            .connect(tcp, addr, client_secrets, None, None)
            .await
            .map_err(|e| e.to_string())?;
        tls.write_all(b"ping").await.map_err(|e| e.to_string())?;
        let mut back = Vec::new();
        tls.read_to_end(&mut back)
            .await
            .map_err(|e| e.to_string())?;
        assert_eq!(back, b"ping");
        Ok(())
    };
    let (client, server) = tokio::join!(call, serve);
    (client, server)
}

#[tokio::test]
async fn mtls_with_spiffe_san_checks_both_ways() {
    let pki = Pki::new();
    let server = downstream(json!({
        "require_client_certificate": true,
        "common_tls_context": {
            "tls_certificates": [certificate(&pki, "server")],
            "validation_context": {"trusted_ca": {"filename": pki.path("ca.pem")},
                "match_typed_subject_alt_names": [{"san_type": "URI",
                    "matcher": {"exact": "spiffe://cluster.local/ns/default/sa/client"}}]}}}))
    .unwrap();
    let client_with = |cert: &str, san: &str| {
        upstream(json!({"sni": "server.test", "common_tls_context": {
            "tls_certificates": [certificate(&pki, cert)],
            "validation_context": {"trusted_ca": {"filename": pki.path("ca.pem")},
                "match_typed_subject_alt_names": [{"san_type": "URI", "matcher": {"exact": san}}]}}}))
        .unwrap()
    };
    let none = Secrets::new();
    let server_id = "spiffe://cluster.local/ns/default/sa/server";

    let (client, served) =
        handshake(&server, &none, &client_with("client", server_id), &none).await;
    assert_eq!((client, served), (Ok(()), Ok(())));

    // The server is not who the client asks for.
    let (client, _) = handshake(
        &server,
        &none,
        &client_with("client", "spiffe://cluster.local/ns/default/sa/other"),
        &none,
    )
    .await;
    let err = client.unwrap_err();
    assert!(err.contains("no subject alternative name matches"), "{err}");

    // A client certificate from a CA the server does not trust.
    let (_, served) = handshake(&server, &none, &client_with("stranger", server_id), &none).await;
    let err = served.unwrap_err();
    assert!(err.contains("UnknownIssuer"), "{err}");

    // No client certificate at all.
    let anonymous = upstream(json!({"common_tls_context": {
        "validation_context": {"trusted_ca": {"filename": pki.path("ca.pem")}}}}))
    .unwrap();
    let (_, served) = handshake(&server, &none, &anonymous, &none).await;
    assert!(served.is_err());
}

#[tokio::test]
async fn named_secrets_are_resolved_per_handshake_and_configs_cached_per_secret() {
    let pki = Pki::new();
    // Istio's form: the certificate is SDS `default`, the CA is `ROOTCA`, with SAN
    // matchers in the combined context's default part.
    let server = downstream(json!({"common_tls_context": {
        "tls_certificate_sds_secret_configs": [{"name": "default", "sds_config": {"ads": {}}}],
        "combined_validation_context": {
            "default_validation_context": {"match_typed_subject_alt_names": [{"san_type": "URI",
                "matcher": {"prefix": "spiffe://cluster.local/"}}]},
            "validation_context_sds_secret_config": {"name": "ROOTCA", "sds_config": {"ads": {}}}}}}))
    .unwrap();
    assert_eq!(
        server.sds_names().collect::<Vec<_>>(),
        ["default", "ROOTCA"]
    );
    let client = upstream(json!({"common_tls_context": {
        "tls_certificates": [certificate(&pki, "client")],
        "validation_context": {"trusted_ca": {"filename": pki.path("ca.pem")}}}}))
    .unwrap();

    // Before the secrets arrive: no config, and the reason names the secret.
    match server.server_configs(&Secrets::new()) {
        Err(HandshakeError::MissingSecret(name)) => assert_eq!(name, "default"),
        other => panic!("{other:?}"),
    }

    let secrets = static_secrets(
        &pki,
        &[
            (
                "default",
                json!({"tls_certificate": certificate(&pki, "server")}),
            ),
            (
                "ROOTCA",
                json!({"validation_context": {"trusted_ca": {"filename": pki.path("ca.pem")}}}),
            ),
        ],
    );
    let first = server.server_configs(&secrets).unwrap();
    assert!(Arc::ptr_eq(
        &first,
        &server.server_configs(&secrets).unwrap()
    ));
    let none = Secrets::new();
    let (called, served) = handshake(&server, &secrets, &client, &none).await;
    assert_eq!((called, served), (Ok(()), Ok(())));

    // A rotation (a new secret under the same name) builds a new config.
    let mut rotated = secrets.clone();
    rotated.insert(
        "default".into(),
        static_secrets(
            &pki,
            &[(
                "default",
                json!({"tls_certificate": certificate(&pki, "server")}),
            )],
        )
        .remove("default")
        .unwrap(),
    );
    let second = server.server_configs(&rotated).unwrap();
    assert!(!Arc::ptr_eq(&first, &second));

    // A ROOTCA that does not sign the client: refused.
    let mut untrusting = secrets.clone();
    untrusting.extend(static_secrets(
        &pki,
        &[(
            "ROOTCA",
            json!({"validation_context": {"trusted_ca": {"filename": pki.path("other-ca.pem")}}}),
        )],
    ));
    let (_, served) = handshake(&server, &untrusting, &client, &none).await;
    assert!(served.is_err());
}

fn chain_of(pki: &Pki, name: &str) -> Vec<rustls::pki_types::CertificateDer<'static>> {
    super::pem::certificates(pki.read(&format!("{name}.pem")).as_bytes()).unwrap()
}

fn validation(pki: &Pki, ca: &str, san: &str) -> secret::ValidationContext {
    let (secret, problems) = secret(json!({"name": "v", "validation_context": {
        "trusted_ca": {"filename": pki.path(ca)},
        "match_typed_subject_alt_names": [{"san_type": "URI", "matcher": {"exact": san}}]}}));
    assert!(problems.errors.is_empty(), "{:?}", problems.errors);
    match secret.unwrap().kind {
        SecretKind::ValidationContext(context) => (*context).clone(),
        SecretKind::TlsCertificate(_) => unreachable!(),
    }
}

#[test]
fn a_verifier_remembers_the_chains_it_accepted_until_they_expire() {
    use rustls::client::danger::ServerCertVerifier;
    use rustls::pki_types::{ServerName, UnixTime};
    use rustls::server::danger::ClientCertVerifier;
    use std::time::{Duration, SystemTime};

    let pki = Pki::new();
    let server_id = "spiffe://cluster.local/ns/default/sa/server";
    let upstream = super::verifier::UpstreamVerifier::new(
        validation(&pki, "ca.pem", server_id),
        secret::provider(),
    );
    let name = ServerName::try_from("server.test").unwrap();
    let check = |chain: &[rustls::pki_types::CertificateDer<'static>], at: UnixTime| {
        upstream
            .verify_server_cert(&chain[0], &chain[1..], &name, &[], at)
            .map(|_| ())
            .map_err(|e| format!("{e:?}"))
    };
    let now = UnixTime::now();
    let server = chain_of(&pki, "server");
    assert_eq!(check(&server, now), Ok(()));
    assert_eq!(check(&server, now), Ok(()));
    assert_eq!(upstream.accepted_chains(), 1);
    // The openssl certificates last two days: remembered or not, an expired chain fails.
    let later = SystemTime::now() + Duration::from_secs(3 * 86_400);
    let later = UnixTime::since_unix_epoch(later.duration_since(SystemTime::UNIX_EPOCH).unwrap());
    let err = check(&server, later).unwrap_err();
    assert!(err.contains("Expired"), "{err}");
    // Refusals are not remembered: the wrong identity, an untrusted issuer.
    let err = check(&chain_of(&pki, "client"), now).unwrap_err();
    assert!(err.contains("no subject alternative name matches"), "{err}");
    let err = check(&chain_of(&pki, "stranger"), now).unwrap_err();
    assert!(err.contains("UnknownIssuer"), "{err}");
    assert_eq!(upstream.accepted_chains(), 1);

    let client_id = "spiffe://cluster.local/ns/default/sa/client";
    let downstream = super::verifier::DownstreamVerifier::new(
        validation(&pki, "ca.pem", client_id),
        true,
        secret::provider(),
    )
    .unwrap()
    .unwrap();
    let client = chain_of(&pki, "client");
    for _ in 0..2 {
        downstream
            .verify_client_cert(&client[0], &client[1..], now)
            .unwrap();
    }
    assert_eq!(downstream.accepted_chains(), 1);
    let err = downstream
        .verify_client_cert(&client[0], &client[1..], later)
        .map(|_| ())
        .unwrap_err();
    assert!(format!("{err:?}").contains("Expired"), "{err:?}");
}

#[test]
fn an_in_process_hand_off_accepted_under_old_roots_is_checked_again_under_new_ones() {
    let pki = Pki::new();
    let server = downstream(json!({
        "require_client_certificate": true,
        "common_tls_context": {
        "tls_certificate_sds_secret_configs": [{"name": "default", "sds_config": {"ads": {}}}],
        "validation_context_sds_secret_config": {"name": "ROOTCA", "sds_config": {"ads": {}}}}}))
    .unwrap();
    let client = upstream(json!({"common_tls_context": {
        "tls_certificates": [certificate(&pki, "client")],
        "validation_context": {"trusted_ca": {"filename": pki.path("ca.pem")}}}}))
    .unwrap();
    let none = Secrets::new();
    let hello = client.in_process_hello(&none).unwrap();
    let roots = |ca: &str| {
        static_secrets(
            &pki,
            &[
                (
                    "default",
                    json!({"tls_certificate": certificate(&pki, "server")}),
                ),
                (
                    "ROOTCA",
                    json!({"validation_context": {"trusted_ca": {"filename": pki.path(ca)}}}),
                ),
            ],
        )
    };
    let trusting = roots("ca.pem");
    for _ in 0..2 {
        server.verify_in_process_client(&trusting, &hello).unwrap();
    }
    // The handshake's verifier remembered the chain once; the hand-off asked the same one.
    let configs = server.server_configs(&trusting).unwrap();
    assert_eq!(configs.accepted_chains(), 1);
    // A ROOTCA rotated to a CA that did not sign the client: refused, remembered or not.
    let err = server
        .verify_in_process_client(&roots("other-ca.pem"), &hello)
        .unwrap_err();
    assert!(err.to_string().contains("UnknownIssuer"), "{err}");

    // The client side likewise checks the server's chain with its handshake's verifier.
    let chain = server.in_process_chain(&trusting).unwrap();
    client.verify_in_process_server(&none, &chain).unwrap();
    client.verify_in_process_server(&none, &chain).unwrap();
    assert_eq!(client.accepted_chains(&none).unwrap(), 1);
}

#[tokio::test]
async fn mtls_prefers_aes_128_gcm_as_envoy_does() {
    let pki = Pki::new();
    let server = downstream(json!({"common_tls_context": {
        "tls_certificates": [certificate(&pki, "server")]}}))
    .unwrap();
    let none = Secrets::new();
    // Every suite of ring's default provider is still offered, in another order.
    let ours: Vec<_> = secret::provider()
        .cipher_suites
        .iter()
        .map(|s| s.suite())
        .collect();
    let mut theirs: Vec<_> = rustls::crypto::ring::default_provider()
        .cipher_suites
        .iter()
        .map(|s| s.suite())
        .collect();
    let mut sorted = ours.clone();
    sorted.sort_by_key(|s| u16::from(*s));
    theirs.sort_by_key(|s| u16::from(*s));
    assert_eq!(sorted, theirs);
    for (versions, expected) in [
        ("TLSv1_3", rustls::CipherSuite::TLS13_AES_128_GCM_SHA256),
        (
            "TLSv1_2",
            rustls::CipherSuite::TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256,
        ),
    ] {
        let client = upstream(json!({"common_tls_context": {"tls_params": {
            "tls_minimum_protocol_version": versions, "tls_maximum_protocol_version": versions}}}))
        .unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let accept = async {
            let (tcp, _) = listener.accept().await.unwrap();
            server.accept(tcp, &none).await.unwrap()
        };
        let connect = async {
            let tcp = TcpStream::connect(addr).await.unwrap();
            client.connect(tcp, addr, &none, None, None).await.unwrap()
        };
        let (served, called) = tokio::join!(accept, connect);
        let suite = |s: Option<rustls::SupportedCipherSuite>| s.map(|s| s.suite());
        assert_eq!(
            suite(called.get_ref().1.negotiated_cipher_suite()),
            Some(expected)
        );
        assert_eq!(
            suite(served.get_ref().1.negotiated_cipher_suite()),
            Some(expected)
        );
    }
}

#[test]
fn context_errors_name_their_paths() {
    let pki = Pki::new();
    assert_eq!(
        downstream(json!({"common_tls_context": {}})).unwrap_err(),
        [(
            "ts.common_tls_context.tls_certificates".to_owned(),
            "terminating TLS needs a certificate (tls_certificates or \
             tls_certificate_sds_secret_configs)"
                .to_owned()
        )]
    );
    let err = downstream(
        json!({"require_client_certificate": true, "common_tls_context": {
        "tls_certificates": [certificate(&pki, "server")]}}),
    )
    .unwrap_err();
    assert_eq!(err[0].0, "ts.common_tls_context");
    assert!(
        err[0]
            .1
            .contains("needs a validation context with trusted_ca"),
        "{err:?}"
    );
    let err = upstream(
        json!({"common_tls_context": {"tls_params": {"tls_maximum_protocol_version": "TLSv1_1"}}}),
    )
    .unwrap_err();
    assert_eq!(err[0].0, "ts.common_tls_context.tls_params");
    let err = upstream(json!({"common_tls_context": {
        "tls_certificates": [{"certificate_chain": {"filename": pki.path("server.pem")}}]}}))
    .unwrap_err();
    assert_eq!(
        err,
        [(
            "ts.common_tls_context.tls_certificates[0].private_key".to_owned(),
            "needed".to_owned()
        )]
    );
}

#[tokio::test]
async fn a_client_offering_none_of_our_alpn_protocols_still_connects_without_alpn() {
    let pki = Pki::new();
    let server = downstream(json!({"common_tls_context": {
        "alpn_protocols": ["h2", "http/1.1"],
        "tls_certificates": [certificate(&pki, "server")]}}))
    .unwrap();
    let client_offering = |protocols: serde_json::Value| {
        upstream(json!({"common_tls_context": {"alpn_protocols": protocols,
            "validation_context": {"trusted_ca": {"filename": pki.path("ca.pem")}}}}))
        .unwrap()
    };
    let none = Secrets::new();
    let negotiated = |client: UpstreamTls| {
        let server = &server;
        let none = &none;
        async move {
            let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap();
            let (client, served) = tokio::join!(
                async {
                    let tcp = TcpStream::connect(addr).await.unwrap();
                    client.connect(tcp, addr, none, None, None).await
                },
                async {
                    let (tcp, _) = listener.accept().await.unwrap();
                    server.accept(tcp, none).await
                }
            );
            let (client, served) = (client.unwrap(), served.unwrap());
            let protocol = |p: Option<&[u8]>| p.map(|p| String::from_utf8_lossy(p).into_owned());
            assert_eq!(
                protocol(client.get_ref().1.alpn_protocol()),
                protocol(served.get_ref().1.alpn_protocol())
            );
            protocol(served.get_ref().1.alpn_protocol())
        }
    };
    assert_eq!(
        negotiated(client_offering(json!(["istio-peer-exchange", "istio"]))).await,
        None
    );
    assert_eq!(
        negotiated(client_offering(json!(["istio-peer-exchange", "h2"]))).await,
        Some("h2".to_owned())
    );
    assert_eq!(negotiated(client_offering(json!([]))).await, None);
}

#[test]
fn istio_style_sni_is_a_valid_server_name() {
    // Istio names the upstream in SNI with underscores and a port label.
    assert!(upstream(json!({"sni": "outbound_.8080_._.b.default.svc.cluster.local"})).is_ok());
    let err = upstream(json!({"sni": "bad name"})).unwrap_err();
    assert_eq!(err[0].0, "ts.sni");
}

#[tokio::test]
async fn the_certificate_whose_dns_san_covers_the_sni_is_served() {
    let pki = Pki::new();
    // The first certificate has no DNS SAN; the second is server.test's.
    let server = downstream(json!({"common_tls_context": {
        "tls_certificates": [certificate(&pki, "client"), certificate(&pki, "server")]}}))
    .unwrap();
    let asking_for = |sni: &str| {
        upstream(json!({"sni": sni, "common_tls_context": {"validation_context": {
            "trusted_ca": {"filename": pki.path("ca.pem")},
            "match_typed_subject_alt_names": [{"san_type": "DNS", "matcher": {"exact": "server.test"}}]}}}))
        .unwrap()
    };
    let none = Secrets::new();
    let (called, _) = handshake(&server, &none, &asking_for("SERVER.test"), &none).await;
    assert_eq!(called, Ok(()));
    // Another name: the first certificate, which is not server.test.
    let (called, _) = handshake(&server, &none, &asking_for("other.test"), &none).await;
    assert!(called.is_err());
}

#[test]
fn wildcard_dns_sans_cover_one_label() {
    assert!(san::dns_covers("*.example.com", "API.example.com"));
    assert!(!san::dns_covers("*.example.com", "a.b.example.com"));
    assert!(!san::dns_covers("*.example.com", "example.com"));
    assert!(san::dns_covers("Server.Test", "server.test"));
    assert!(!san::dns_covers("server.test", "other.test"));
}

#[tokio::test]
async fn on_a_deferring_worker_a_sessions_records_leave_when_the_run_ends() {
    // This test's thread becomes a worker that defers writes (`event::deferred_write`).
    tokio::spawn(shunt_core::event::deferred_write::flusher());
    tokio::task::yield_now().await;
    let pki = Pki::new();
    let server = downstream(json!({"common_tls_context": {
        "tls_certificates": [certificate(&pki, "server")]}}))
    .unwrap();
    let client = upstream(json!({"sni": "server.test", "common_tls_context": {
        "validation_context": {"trusted_ca": {"filename": pki.path("ca.pem")}}}}))
    .unwrap();
    let none = Secrets::new();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (served, called) = tokio::join!(
        async {
            server
                .accept(listener.accept().await.unwrap().0, &none)
                .await
        },
        async {
            let tcp = TcpStream::connect(addr).await.unwrap();
            client.connect(tcp, addr, &none, None, None).await
        }
    );
    let (mut served, called) = (served.unwrap(), called.unwrap());
    // The client's raw socket, read under its session: what has arrived so far.
    let raw = called.get_ref().0.tcp().unwrap();
    let arrived = || {
        let mut got = vec![0; 64 * 1024];
        match raw.try_read(&mut got) {
            Ok(n) => got.truncate(n),
            Err(err) if err.kind() == std::io::ErrorKind::WouldBlock => got.clear(),
            Err(err) => panic!("read: {err}"),
        }
        got
    };
    // The server's session tickets, sent after the handshake.
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    arrived();
    // A response's head, then its body: two records.
    served.write_all(b"HTTP/1.1 200 OK\r\n\r\n").await.unwrap();
    served.write_all(b"body").await.unwrap();
    served.flush().await.unwrap();
    assert_eq!(arrived(), b"", "a record left before the run ended");
    tokio::task::yield_now().await;
    raw.readable().await.unwrap();
    let records = arrived();
    // Each: a 5-byte header, the text, its content type and a 16-byte tag.
    let sizes = [19, 4].map(|text| 5 + text + 1 + 16);
    assert_eq!(
        records.len(),
        sizes.iter().sum::<usize>(),
        "both records at once"
    );
    assert_eq!(records[0], 0x17, "application data");
    assert_eq!(records[sizes[0]], 0x17, "application data");
}
