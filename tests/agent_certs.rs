//! The agent's certificates (issue 12): the CA client against a test mesh CA (issuance,
//! rotation, an outage, a rejected token), the SDS server feeding a real Envoy 1.40
//! that does mTLS with its certificate and follows a rotation, and Istio's mounted-file
//! mode pushed over SDS when the files change.
//!
//! The agent's parts run in this test process (the library `shunt agent` is built on);
//! the CA, Envoy and the TLS client (`openssl s_client`) are real peers.

mod support;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use harness::Node;
use harness::ca::TestCa;
use serde_json::json;
use shunt::agent::ca::{Bundle, CaOptions, CertificateProvider, FileOptions, KeyType};
use shunt::agent::sds;
use shunt::upstream::backoff::Backoff;
use support::TempDir;
use support::pki::{leaf, uris};
use x509_parser::prelude::{FromDer, X509Certificate};

const TOKEN: &str = "the-service-account-token";
const IDENTITY: &str = "spiffe://cluster.local/ns/default/sa/sleep";

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// The CA client's options for `ca`, with the token in `dir/istio-token` and quick
/// back-off.
fn options(ca: &TestCa, dir: &Path) -> CaOptions {
    let mut options = CaOptions::new(ca.address(), "default", "sleep");
    options.root_cert = ca.root_file.clone();
    options.token_path = dir.join("istio-token");
    options.cluster_id = "east".into();
    options.ttl = Duration::from_secs(3600);
    options.backoff = Backoff::exponential(Duration::from_millis(100), Duration::from_secs(1));
    options.timeout = Duration::from_secs(5);
    options
}

/// Waits (in `rt`) for a bundle that is not `previous`, failing with the source's status.
fn next_bundle(
    rt: &tokio::runtime::Runtime,
    provider: &CertificateProvider,
    previous: Option<&Bundle>,
) -> Arc<Bundle> {
    let mut rx = provider.subscribe();
    let wait = async {
        loop {
            if let Some(bundle) = rx.borrow_and_update().clone()
                && previous.is_none_or(|p| p.serial != bundle.serial)
            {
                return bundle;
            }
            rx.changed().await.expect("the certificate source ended");
        }
    };
    rt.block_on(async { tokio::time::timeout(Duration::from_secs(30), wait).await })
        .unwrap_or_else(|_| panic!("no new certificate; status {:?}", provider.status()))
}

/// Polls `check` for 30 s at most.
fn eventually(what: &str, mut check: impl FnMut() -> bool, context: impl Fn() -> String) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !check() {
        assert!(
            Instant::now() < deadline,
            "timed out: {what}\n{}",
            context()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn key_algorithm(der: &[u8]) -> String {
    let (_, cert) = X509Certificate::from_der(der).unwrap();
    cert.public_key().algorithm.algorithm.to_id_string()
}

const EC_PUBLIC_KEY: &str = "1.2.840.10045.2.1";
const RSA_ENCRYPTION: &str = "1.2.840.113549.1.1.1";

#[test]
fn the_ca_issues_a_spiffe_certificate_and_it_is_rotated_before_it_expires() {
    let dir = TempDir::new("ca-issue");
    let ca = TestCa::start(&dir.0, TOKEN, Duration::from_secs(4)).unwrap();
    std::fs::write(dir.0.join("istio-token"), format!("{TOKEN}\n")).unwrap();
    let rt = runtime();
    let (provider, _task) =
        rt.block_on(async { CertificateProvider::start_ca(options(&ca, &dir.0)) });

    let first = next_bundle(&rt, &provider, None);
    assert_eq!(first.uris, [IDENTITY]);
    assert_eq!(key_algorithm(&leaf(&first.cert_chain)), EC_PUBLIC_KEY);
    assert_eq!(first.root_cert, ca.root_pem);
    let call = &ca.calls()[0];
    assert_eq!(
        call.authorization.as_deref(),
        Some(&*format!("Bearer {TOKEN}"))
    );
    assert_eq!(call.cluster_id.as_deref(), Some("east"));
    assert_eq!(
        (call.validity_duration, &call.uris[..]),
        (3600, &[IDENTITY.to_owned()][..])
    );

    let second = next_bundle(&rt, &provider, Some(&first));
    assert!(
        SystemTime::now() < first.not_after,
        "rotated only after the first certificate expired"
    );
    assert!(second.not_after > first.not_after);
    assert_ne!(
        second.private_key, first.private_key,
        "a new key for each certificate"
    );
    assert_eq!(provider.status().issued, 2);

    // The in-process proxy's secret store takes the same two secrets.
    let secrets = second.tls_secrets().unwrap();
    let mut names: Vec<_> = secrets.keys().cloned().collect();
    names.sort();
    assert_eq!(names, ["ROOTCA", "default"]);
}

#[test]
fn an_rsa_key_by_option() {
    let dir = TempDir::new("ca-rsa");
    let ca = TestCa::start(&dir.0, TOKEN, Duration::from_secs(3600)).unwrap();
    std::fs::write(dir.0.join("istio-token"), TOKEN).unwrap();
    let rt = runtime();
    let mut options = options(&ca, &dir.0);
    options.key_type = KeyType::Rsa2048;
    let (provider, _task) = rt.block_on(async { CertificateProvider::start_ca(options) });
    let bundle = next_bundle(&rt, &provider, None);
    assert_eq!(key_algorithm(&leaf(&bundle.cert_chain)), RSA_ENCRYPTION);
    assert_eq!(bundle.uris, [IDENTITY]);
}

#[test]
fn a_ca_outage_keeps_the_old_certificate_backs_off_and_recovers() {
    let dir = TempDir::new("ca-outage");
    let mut ca = TestCa::start(&dir.0, TOKEN, Duration::from_secs(4)).unwrap();
    std::fs::write(dir.0.join("istio-token"), TOKEN).unwrap();
    let rt = runtime();
    let (provider, _task) =
        rt.block_on(async { CertificateProvider::start_ca(options(&ca, &dir.0)) });
    let first = next_bundle(&rt, &provider, None);

    ca.stop();
    eventually(
        "rotation attempts fail while the CA is down",
        || provider.status().consecutive_failures >= 3,
        || format!("{:?}", provider.status()),
    );
    let status = provider.status();
    assert!(
        status
            .last_error
            .as_deref()
            .unwrap_or("")
            .contains("connecting to the CA"),
        "{status:?}"
    );
    assert_eq!(
        provider.current().unwrap().serial,
        first.serial,
        "the old certificate stays"
    );

    ca.restart().unwrap();
    let recovered = next_bundle(&rt, &provider, Some(&first));
    assert_eq!(recovered.uris, [IDENTITY]);
    let status = provider.status();
    assert_eq!((status.consecutive_failures, status.last_error), (0, None));
}

#[test]
fn a_rejected_token_is_a_clear_error_and_is_retried_with_the_token_read_again() {
    let dir = TempDir::new("ca-token");
    let ca = TestCa::start(&dir.0, TOKEN, Duration::from_secs(3600)).unwrap();
    let token_file = dir.0.join("istio-token");
    std::fs::write(&token_file, "an-expired-token").unwrap();
    let rt = runtime();
    let (provider, _task) =
        rt.block_on(async { CertificateProvider::start_ca(options(&ca, &dir.0)) });

    eventually(
        "the CA refuses the token, twice",
        || provider.status().failures >= 2,
        || format!("{:?}", provider.status()),
    );
    let error = provider.status().last_error.unwrap();
    assert!(
        error.contains("Unauthenticated") && error.contains("token"),
        "{error}"
    );
    assert!(provider.current().is_none());
    assert!(
        ca.calls().iter().all(|c| c.refused.is_some()
            && c.authorization.as_deref() == Some("Bearer an-expired-token"))
    );

    // Kubelet writes a fresh token: the next attempt reads it.
    std::fs::write(&token_file, TOKEN).unwrap();
    let bundle = next_bundle(&rt, &provider, None);
    assert_eq!(bundle.uris, [IDENTITY]);
    let last = ca.calls().pop().unwrap();
    assert_eq!(
        (last.authorization, last.refused),
        (Some(format!("Bearer {TOKEN}")), None)
    );
}

/// Istio's `sds_config` for `default` and `ROOTCA`: the `sds-grpc` cluster.
fn sds_config() -> serde_json::Value {
    json!({
        "api_config_source": {
            "api_type": "GRPC",
            "set_node_on_first_message_only": true,
            "transport_api_version": "V3",
            "grpc_services": [{"envoy_grpc": {"cluster_name": "sds-grpc"}}]
        },
        "initial_fetch_timeout": "0s",
        "resource_api_version": "V3"
    })
}

/// Envoy with Istio's `sds-grpc` cluster (a pipe, HTTP/2) and one mTLS listener on
/// `port` whose certificate and trust come over SDS; it answers a line and closes.
fn envoy_bootstrap(socket: &Path, port: u16) -> serde_json::Value {
    json!({
        "node": {"id": "sidecar~10.0.0.1~sleep.default~default.svc.cluster.local", "cluster": "sleep.default"},
        "static_resources": {
            "clusters": [{
                "name": "sds-grpc",
                "type": "STATIC",
                "connect_timeout": "1s",
                "typed_extension_protocol_options": {
                    "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                        "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                        "explicit_http_config": {"http2_protocol_options": {}}
                    }
                },
                "load_assignment": {
                    "cluster_name": "sds-grpc",
                    "endpoints": [{"lb_endpoints": [{"endpoint": {"address": {"pipe": {"path": socket}}}}]}]
                }
            }],
            "listeners": [{
                "name": "mtls",
                "address": support::envoy::socket_address("127.0.0.1", port),
                "filter_chains": [{
                    // An HTTP answer, not the direct_response network filter: that one
                    // writes and closes on accept, before the handshake ends, and Envoy
                    // then closes without the bytes (a TLS socket cannot flush-close
                    // mid-handshake), so its exchanges failed at random.
                    "filters": [{
                        "name": "envoy.filters.network.http_connection_manager",
                        "typed_config": {
                            "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                            "stat_prefix": "mtls",
                            "route_config": {"virtual_hosts": [{
                                "name": "all",
                                "domains": ["*"],
                                "routes": [{
                                    "match": {"prefix": "/"},
                                    "direct_response": {"status": 200, "body": {"inline_string": "hello over mTLS\n"}}
                                }]
                            }]},
                            "http_filters": [{
                                "name": "envoy.filters.http.router",
                                "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}
                            }]
                        }
                    }],
                    "transport_socket": {
                        "name": "envoy.transport_sockets.tls",
                        "typed_config": {
                            "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext",
                            "require_client_certificate": true,
                            "common_tls_context": {
                                "tls_certificate_sds_secret_configs": [{"name": "default", "sds_config": sds_config()}],
                                "combined_validation_context": {
                                    "default_validation_context": {
                                        "match_typed_subject_alt_names": [{
                                            "san_type": "URI",
                                            "matcher": {"exact": "spiffe://cluster.local/ns/default/sa/client"}
                                        }]
                                    },
                                    "validation_context_sds_secret_config": {"name": "ROOTCA", "sds_config": sds_config()}
                                }
                            }
                        }
                    }
                }]
            }]
        }
    })
}

/// What `openssl s_client` (in `pod`, as `client`) gets from 127.0.0.1:`port`: the
/// server's leaf (DER) if the chain verified against `root` and the exchange completed.
fn mtls_exchange(
    pod: &harness::Pod,
    port: u16,
    root: &Path,
    client: Option<(&Path, &Path)>,
) -> Result<Vec<u8>, String> {
    let connect = format!("127.0.0.1:{port}");
    let mut args = vec![
        "s_client",
        "-connect",
        &connect,
        "-CAfile",
        root.to_str().unwrap(),
        "-verify_return_error",
        "-showcerts",
        "-ign_eof",
    ];
    if let Some((cert, key)) = client {
        args.extend([
            "-cert",
            cert.to_str().unwrap(),
            "-key",
            key.to_str().unwrap(),
        ]);
    }
    let out = pod
        .command("openssl")
        .args(&args)
        .stdin_bytes(&b"GET / HTTP/1.1\r\nhost: mtls\r\nconnection: close\r\n\r\n"[..])
        .timeout(Duration::from_secs(10))
        .output()
        .map_err(|e| e.to_string())?;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    if !stdout.contains("hello over mTLS") || !stdout.contains("Verify return code: 0 (ok)") {
        return Err(format!(
            "{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(leaf(&stdout))
}

#[test]
fn envoy_gets_its_certificates_from_shunts_sds_does_mtls_and_follows_a_rotation() {
    let dir = TempDir::new("sds-envoy");
    let ca = TestCa::start(&dir.0, TOKEN, Duration::from_secs(8)).unwrap();
    std::fs::write(dir.0.join("istio-token"), TOKEN).unwrap();
    let (client_chain, client_key) = ca
        .issue(
            "spiffe://cluster.local/ns/default/sa/client",
            Duration::from_secs(3600),
        )
        .unwrap();
    let (client_cert, client_key_file) = (dir.0.join("client.pem"), dir.0.join("client.key"));
    std::fs::write(&client_cert, client_chain).unwrap();
    std::fs::write(&client_key_file, client_key).unwrap();

    let rt = runtime();
    let socket: PathBuf = dir.0.join("var/run/secrets/workload-spiffe-uds/socket");
    let (provider, _task) =
        rt.block_on(async { CertificateProvider::start_ca(options(&ca, &dir.0)) });
    let listener = rt.block_on(async { sds::bind(&socket) }).unwrap();
    rt.spawn(sds::serve(
        listener,
        provider.clone(),
        std::future::pending(),
    ));
    // Envoy starts once shunt has a certificate to serve.
    next_bundle(&rt, &provider, None);

    let mut node = Node::new().unwrap();
    let pod = node.add_pod("e").unwrap();
    const PORT: u16 = 15443;
    let config = dir.0.join("envoy.json");
    std::fs::write(&config, envoy_bootstrap(&socket, PORT).to_string()).unwrap();
    let envoy = pod
        .command(support::envoy::bin())
        .args([
            "--concurrency",
            "1",
            "-l",
            "warning",
            "--base-id",
            "47",
            "-c",
        ])
        .arg(&config)
        .spawn()
        .expect("start envoy");
    harness::wait_for_port(&pod, support::local(PORT), Duration::from_secs(30))
        .unwrap_or_else(|e| panic!("Envoy's mTLS listener: {e}\n{}", envoy.stderr_text()));

    let client = Some((client_cert.as_path(), client_key_file.as_path()));
    let served = std::cell::RefCell::new(Err(String::new()));
    eventually(
        "an mTLS exchange with Envoy",
        || {
            *served.borrow_mut() = mtls_exchange(&pod, PORT, &ca.root_file, client);
            served.borrow().is_ok()
        },
        || format!("{:?}\nenvoy: {}", served.borrow(), envoy.stderr_text()),
    );
    let served_first = served.borrow().clone().unwrap();
    assert_eq!(
        uris(&served_first),
        [IDENTITY],
        "Envoy serves the workload identity"
    );
    // The certificates live seconds: on a loaded machine more than one rotation may
    // pass before the handshake, so the served leaf is one shunt issued (the chain was
    // verified against the test CA, the identity above), not necessarily the first.
    assert!(
        mtls_exchange(&pod, PORT, &ca.root_file, None).is_err(),
        "a client without a certificate is refused (require_client_certificate)"
    );

    // A rotation reaches Envoy: the next handshakes serve the provider's current
    // certificate, a newer one than the first served.
    let current = provider.current().unwrap();
    let _ = next_bundle(&rt, &provider, Some(&current));
    eventually(
        "Envoy serves the rotated certificate",
        || {
            *served.borrow_mut() = mtls_exchange(&pod, PORT, &ca.root_file, client);
            let now = provider.current().unwrap();
            served
                .borrow()
                .as_ref()
                .is_ok_and(|der| *der != served_first && *der == leaf(&now.cert_chain))
        },
        || format!("{:?}\nenvoy: {}", served.borrow(), envoy.stderr_text()),
    );
    assert_ne!(served.into_inner().unwrap(), served_first);
    drop(envoy);
}

#[test]
fn mounted_files_are_served_over_sds_and_a_replacement_is_pushed() {
    use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::{Secret, secret};
    use envoy_types::pb::envoy::service::discovery::v3::DiscoveryRequest;
    use envoy_types::pb::envoy::service::secret::v3::secret_discovery_service_client::SecretDiscoveryServiceClient;
    use envoy_types::pb::google::rpc::Status as RpcStatus;
    use prost::Message;

    let dir = TempDir::new("sds-files");
    let ca = TestCa::start(&dir.0, TOKEN, Duration::from_secs(3600)).unwrap();
    let certs = dir.0.join("etc/certs");
    std::fs::create_dir_all(&certs).unwrap();
    // Each replacement is written aside and renamed in, as a Secret volume swaps files.
    let install = |name: &str, text: &str| {
        let tmp = certs.join(format!(".{name}.tmp"));
        std::fs::write(&tmp, text).unwrap();
        std::fs::rename(&tmp, certs.join(name)).unwrap();
    };
    let issue = || ca.issue(IDENTITY, Duration::from_secs(3600)).unwrap();
    let (chain1, key1) = issue();
    install("root-cert.pem", &ca.root_pem);
    install("key.pem", &key1);
    install("cert-chain.pem", &chain1);

    let rt = runtime();
    let socket = dir.0.join("sds.sock");
    let (provider, _task) = rt
        .block_on(async {
            CertificateProvider::start_files(FileOptions {
                dir: certs.clone(),
                poll: Duration::from_millis(100),
            })
        })
        .unwrap();
    let listener = rt.block_on(async { sds::bind(&socket) }).unwrap();
    rt.spawn(sds::serve(
        listener,
        provider.clone(),
        std::future::pending(),
    ));

    rt.block_on(async {
        let channel = sds_channel(&socket).await;
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<DiscoveryRequest>();
        let names = vec!["default".to_owned(), "ROOTCA".to_owned()];
        let request = |version: &str, nonce: &str, error: Option<&str>| DiscoveryRequest {
            version_info: version.into(),
            resource_names: names.clone(),
            type_url: sds::SECRET_TYPE_URL.into(),
            response_nonce: nonce.into(),
            error_detail: error.map(|m| RpcStatus {
                code: 3,
                message: m.into(),
                ..Default::default()
            }),
            ..Default::default()
        };
        tx.send(request("", "", None)).unwrap();
        let mut responses = SecretDiscoveryServiceClient::new(channel)
            .stream_secrets(tokio_stream::wrappers::UnboundedReceiverStream::new(rx))
            .await
            .unwrap()
            .into_inner();
        let mut next = async || {
            let response = tokio::time::timeout(Duration::from_secs(30), responses.message())
                .await
                .expect("an SDS push")
                .unwrap()
                .expect("the stream stays open");
            let secrets: Vec<Secret> = response
                .resources
                .iter()
                .map(|any| Secret::decode(&any.value[..]).unwrap())
                .collect();
            (response, secrets)
        };
        let chain_of = |secrets: &[Secret]| match &secrets[0].r#type {
            Some(secret::Type::TlsCertificate(c)) => match &c
                .certificate_chain
                .as_ref()
                .unwrap()
                .specifier
            {
                Some(
                    envoy_types::pb::envoy::config::core::v3::data_source::Specifier::InlineBytes(
                        b,
                    ),
                ) => String::from_utf8(b.clone()).unwrap(),
                other => panic!("chain as {other:?}"),
            },
            other => panic!("default is {other:?}"),
        };

        let (r1, secrets) = next().await;
        assert_eq!(
            secrets.iter().map(|s| s.name.as_str()).collect::<Vec<_>>(),
            ["default", "ROOTCA"]
        );
        assert_eq!(chain_of(&secrets), chain1);
        match &secrets[1].r#type {
            Some(secret::Type::ValidationContext(v)) => {
                assert_eq!(
                v.trusted_ca.as_ref().unwrap().specifier,
                Some(envoy_types::pb::envoy::config::core::v3::data_source::Specifier::InlineBytes(
                    ca.root_pem.clone().into_bytes()
                ))
            )
            }
            other => panic!("ROOTCA is {other:?}"),
        }
        tx.send(request(&r1.version_info, &r1.nonce, None)).unwrap(); // ACK

        // New files: pushed without being asked.
        let (chain2, key2) = issue();
        install("key.pem", &key2);
        install("cert-chain.pem", &chain2);
        let (r2, secrets) = next().await;
        assert_eq!(chain_of(&secrets), chain2);
        assert_ne!((&r2.version_info, &r2.nonce), (&r1.version_info, &r1.nonce));

        // A NACK is logged, not fatal: the stream carries the next replacement.
        tx.send(request(
            &r1.version_info,
            &r2.nonce,
            Some("rejected for the test"),
        ))
        .unwrap();
        let (chain3, key3) = issue();
        install("key.pem", &key3);
        install("cert-chain.pem", &chain3);
        let (r3, secrets) = next().await;
        assert_eq!(chain_of(&secrets), chain3);
        assert_ne!(r3.nonce, r2.nonce);
    });
    assert_eq!(provider.current().unwrap().uris, [IDENTITY]);
}

/// A gRPC channel to the SDS server on the Unix socket `path`.
async fn sds_channel(path: &Path) -> tonic::transport::Channel {
    let path = path.to_owned();
    tonic::transport::Endpoint::try_from("http://sds")
        .unwrap()
        .connect_with_connector(tower::service_fn(move |_: tonic::codegen::http::Uri| {
            let path = path.clone();
            async move {
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(
                    tokio::net::UnixStream::connect(path).await?,
                ))
            }
        }))
        .await
        .unwrap()
}

#[test]
fn sds_answers_new_names_ignores_stale_nonces_and_refuses_delta() {
    use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::Secret;
    use envoy_types::pb::envoy::service::discovery::v3::{DeltaDiscoveryRequest, DiscoveryRequest};
    use envoy_types::pb::envoy::service::secret::v3::secret_discovery_service_client::SecretDiscoveryServiceClient;
    use prost::Message;

    let dir = TempDir::new("sds-protocol");
    let ca = TestCa::start(&dir.0, TOKEN, Duration::from_secs(3600)).unwrap();
    let (chain, key) = ca.issue(IDENTITY, Duration::from_secs(3600)).unwrap();
    let provider =
        CertificateProvider::fixed(Bundle::new(chain, key, ca.root_pem.clone()).unwrap());
    let rt = runtime();
    let socket = dir.0.join("sds.sock");
    let listener = rt.block_on(async { sds::bind(&socket) }).unwrap();
    rt.spawn(sds::serve(listener, provider, std::future::pending()));

    rt.block_on(async {
        let mut client = SecretDiscoveryServiceClient::new(sds_channel(&socket).await);
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<DiscoveryRequest>();
        let request = |names: &[&str], version: &str, nonce: &str| DiscoveryRequest {
            version_info: version.into(),
            resource_names: names.iter().map(|n| n.to_string()).collect(),
            type_url: sds::SECRET_TYPE_URL.into(),
            response_nonce: nonce.into(),
            ..Default::default()
        };
        tx.send(request(&["default"], "", "")).unwrap();
        let mut responses = client
            .stream_secrets(tokio_stream::wrappers::UnboundedReceiverStream::new(rx))
            .await
            .unwrap()
            .into_inner();
        let mut next = async || {
            let response = tokio::time::timeout(Duration::from_secs(30), responses.message())
                .await
                .expect("an SDS response")
                .unwrap()
                .expect("the stream stays open");
            let names: Vec<String> = response
                .resources
                .iter()
                .map(|any| Secret::decode(&any.value[..]).unwrap().name)
                .collect();
            (response, names)
        };
        let (r1, names) = next().await;
        assert_eq!(names, ["default"]);

        // A request answering a nonce never sent is stale: its names are not taken. Had
        // it been, the next response would carry ROOTCA alone.
        tx.send(request(&["ROOTCA"], &r1.version_info, "not-a-nonce"))
            .unwrap();
        // The ACK of r1 asking for both: answered with both, the same version.
        tx.send(request(&["default", "ROOTCA"], &r1.version_info, &r1.nonce))
            .unwrap();
        let (r2, names) = next().await;
        assert_eq!(names, ["default", "ROOTCA"]);
        assert_eq!(r2.version_info, r1.version_info);
        assert_ne!(r2.nonce, r1.nonce);

        // Unknown names are left out rather than invented.
        tx.send(request(
            &["ROOTCA", "file-cert:/x"],
            &r2.version_info,
            &r2.nonce,
        ))
        .unwrap();
        let (_, names) = next().await;
        assert_eq!(names, ["ROOTCA"]);

        let delta = client
            .delta_secrets(tokio_stream::iter([DeltaDiscoveryRequest::default()]))
            .await
            .unwrap_err();
        assert_eq!(delta.code(), tonic::Code::Unimplemented);
    });
}
