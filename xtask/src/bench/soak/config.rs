//! What the soak's control plane serves, how its updates change it, and the
//! certificates of the mTLS listener/cluster pair.
//!
//! Listeners (all on the proxy pod's 127.0.0.1):
//! - `http` :20000, HTTP/1.1 and h2c, routes `http` over RDS: `/a` to `web-a`, `/b` to
//!   `web-b`, everything else split by weight between `web-a`, `web-b` and, for part of
//!   each cycle, `web-c`;
//! - `tcp` :20001, `tcp_proxy` to `echo` (`max_connect_attempts` 3);
//! - `mtls-out` :20002, plain HTTP whose routes go to cluster `mtls-in`: that cluster
//!   originates mTLS (client certificate, the CA, SNI `server.test`) to
//! - `mtls-in` on the proxy pod's own address :20003, which terminates it (server
//!   certificate, client certificate required) and routes to `web-a`. Not on
//!   127.0.0.1: shunt refuses an HTTP upstream that is one of its own listeners there
//!   (a loop); through the pod's address it is what a request to another pod's sidecar
//!   looks like.
//!
//! Every route retries twice on connect failures and resets (Istio's default of 2
//! retries; other hosts are tried first), as a mesh's traffic would.
//!
//! What comes and goes each cycle does so under a fresh name, as Services and
//! DestinationRule subsets do in a mesh: the cluster `web-c-<n>` (the `web-c`
//! endpoints), and a listener `churn-<n>` on :20004 whose routes come over RDS as
//! `churn-<n>`. The proxy's memory and `/stats` must stay flat all the same: the stats
//! of what went must go with it.

use std::{
    net::{IpAddr, Ipv4Addr, SocketAddr},
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, Result, ensure};
use envoy_types::pb::envoy::config::cluster::v3::Cluster;
use envoy_types::pb::envoy::config::core::v3::{
    DataSource, TransportSocket, data_source, transport_socket,
};
use envoy_types::pb::envoy::config::listener::v3::{Listener, filter};
use envoy_types::pb::envoy::config::route::v3::{
    RetryPolicy, Route, RouteAction, RouteConfiguration, RouteMatch, VirtualHost, WeightedCluster,
    route, route_action, route_match, weighted_cluster::ClusterWeight,
};
use envoy_types::pb::envoy::extensions::filters::network::tcp_proxy::v3::{
    TcpProxy, tcp_proxy::ClusterSpecifier,
};
use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::{
    CertificateValidationContext, CommonTlsContext, DownstreamTlsContext, TlsCertificate,
    UpstreamTlsContext, common_tls_context::ValidationContextType,
};
use envoy_types::pb::google::protobuf::{BoolValue, UInt32Value};
use harness::ads::resources::{
    ads_source, eds_cluster, http_listener, load_assignment, named, tcp_proxy_listener,
};
use harness::ads::{AdsServer, Any, type_urls};

pub(crate) const HTTP_PORT: u16 = 20000;
pub(crate) const TCP_PORT: u16 = 20001;
pub(crate) const MTLS_OUT_PORT: u16 = 20002;
pub(crate) const MTLS_IN_PORT: u16 = 20003;
pub(crate) const LISTEN_PORTS: [u16; 4] = [HTTP_PORT, TCP_PORT, MTLS_OUT_PORT, MTLS_IN_PORT];
/// The churned listener's port (not in `LISTEN_PORTS`: it comes and goes).
pub(crate) const CHURN_PORT: u16 = 20004;
/// The name the mTLS server's certificate carries, and the SNI the cluster sends.
pub(crate) const SERVER_NAME: &str = "server.test";

/// One upstream endpoint: `testapp serve --mode MODE` on the server pod's PORT.
pub(crate) struct Endpoint {
    pub(crate) cluster: &'static str,
    pub(crate) port: u16,
    pub(crate) mode: &'static str,
    /// Stopped and restarted by the flapper (the extra `web-a` endpoint stays up: it
    /// comes and goes through EDS instead).
    pub(crate) flaps: bool,
}

const fn endpoint(cluster: &'static str, port: u16, mode: &'static str, flaps: bool) -> Endpoint {
    Endpoint {
        cluster,
        port,
        mode,
        flaps,
    }
}

pub(crate) const ENDPOINTS: [Endpoint; 9] = [
    endpoint("web-a", 8080, "http", true),
    endpoint("web-a", 8081, "http", true),
    endpoint("web-a", 8086, "http", false),
    endpoint("web-b", 8082, "http", true),
    endpoint("web-b", 8083, "http", true),
    endpoint("web-c", 8084, "http", true),
    endpoint("web-c", 8085, "http", true),
    endpoint("echo", 9000, "echo", true),
    endpoint("echo", 9001, "echo", true),
];

/// The clusters of the upstreams (`mtls-in` is the proxy's own listener).
const UPSTREAM_CLUSTERS: [&str; 4] = ["web-a", "web-b", "web-c", "echo"];

/// One xDS update; a cycle runs them in order, one per interval. Clusters come before
/// the routes that use them and go after them (make before break), as istiod orders it.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Step {
    /// RDS: `web-a`/`web-b` weights 80/20 <-> 20/80.
    SwapWeights,
    /// CDS: `web-c-<n>` appears, under the next fresh name.
    AddCluster,
    /// RDS: the weighted route sends some traffic to `web-c-<n>`; route config
    /// `churn-<n>` appears.
    RouteToAdded,
    /// LDS: listener `churn-<n>` appears.
    AddListener,
    /// EDS: `web-a` gains or loses its third endpoint.
    MoveEndpoints,
    /// LDS: listener `churn-<n>` is gone.
    RemoveListener,
    /// RDS: no traffic to `web-c-<n>` any more; route config `churn-<n>` is gone.
    RouteAwayFromAdded,
    /// CDS: `web-c-<n>` is gone.
    RemoveCluster,
}

pub(crate) const CYCLE: [Step; 8] = [
    Step::SwapWeights,
    Step::AddCluster,
    Step::RouteToAdded,
    Step::AddListener,
    Step::MoveEndpoints,
    Step::RemoveListener,
    Step::RouteAwayFromAdded,
    Step::RemoveCluster,
];

/// What the updates change.
#[derive(Default)]
pub(crate) struct State {
    heavy_b: bool,
    web_c: bool,
    route_c: bool,
    a_extra: bool,
    churn_listener: bool,
    /// The churned resources' generation: their names end in it.
    generation: u64,
}

impl State {
    /// The xDS name of upstream cluster `cluster`: `web-c` under its generation's name.
    pub(crate) fn cluster_name(&self, cluster: &str) -> String {
        if cluster == "web-c" {
            format!("web-c-{}", self.generation)
        } else {
            cluster.to_owned()
        }
    }

    /// The churned listener's and route config's name.
    fn churn_name(&self) -> String {
        format!("churn-{}", self.generation)
    }

    /// Applies `step`; returns the types it changes, in the order to push them.
    pub(crate) fn apply(&mut self, step: Step) -> &'static [&'static str] {
        match step {
            Step::SwapWeights => {
                self.heavy_b = !self.heavy_b;
                &[type_urls::ROUTE]
            }
            Step::AddCluster => {
                self.web_c = true;
                self.generation += 1;
                // A control plane has a Service's endpoints before its cluster: the
                // proxy that asks for them gets them, and its cluster warms.
                &[type_urls::ENDPOINT, type_urls::CLUSTER]
            }
            Step::AddListener => {
                self.churn_listener = true;
                &[type_urls::LISTENER]
            }
            Step::RemoveListener => {
                self.churn_listener = false;
                &[type_urls::LISTENER]
            }
            Step::RouteToAdded => {
                self.route_c = true;
                &[type_urls::ROUTE]
            }
            Step::MoveEndpoints => {
                self.a_extra = !self.a_extra;
                &[type_urls::ENDPOINT]
            }
            Step::RouteAwayFromAdded => {
                self.route_c = false;
                &[type_urls::ROUTE]
            }
            Step::RemoveCluster => {
                self.web_c = false;
                &[type_urls::CLUSTER]
            }
        }
    }
}

/// Everything the server holds for the state: (type URL, resources).
pub(crate) struct Config<'a> {
    /// The server pod's address (the upstreams) and the proxy pod's (`mtls-in`).
    pub(crate) server: Ipv4Addr,
    pub(crate) proxy: Ipv4Addr,
    pub(crate) tls: &'a Tls,
}

impl Config<'_> {
    pub(crate) fn resources(&self, state: &State, type_url: &str) -> Vec<(String, Any)> {
        match type_url {
            type_urls::CLUSTER => self.clusters(state),
            type_urls::ENDPOINT => self.endpoints(state),
            type_urls::LISTENER => self.listeners(state),
            type_urls::ROUTE => routes(state),
            other => unreachable!("the soak serves no {other}"),
        }
    }

    fn clusters(&self, state: &State) -> Vec<(String, Any)> {
        let mut clusters: Vec<(String, Any)> = UPSTREAM_CLUSTERS
            .iter()
            .filter(|c| **c != "web-c" || state.web_c)
            .map(|c| {
                let name = state.cluster_name(c);
                named(&name, &eds_cluster(&name, ads_source(), 1))
            })
            .collect();
        let mut mtls = eds_cluster("mtls-in", ads_source(), 1);
        mtls.transport_socket = Some(tls_socket(AdsServer::any(&UpstreamTlsContext {
            common_tls_context: Some(self.tls.common(&self.tls.client)),
            sni: SERVER_NAME.into(),
            ..Default::default()
        })));
        clusters.push(named::<Cluster>("mtls-in", &mtls));
        clusters
    }

    fn endpoints(&self, state: &State) -> Vec<(String, Any)> {
        let mut assignments: Vec<(String, Any)> = UPSTREAM_CLUSTERS
            .iter()
            .map(|c| {
                let addrs: Vec<SocketAddr> = ENDPOINTS
                    .iter()
                    .filter(|e| e.cluster == *c && (e.flaps || state.a_extra))
                    .map(|e| SocketAddr::new(self.server.into(), e.port))
                    .collect();
                let name = state.cluster_name(c);
                named(&name, &load_assignment(&name, &addrs))
            })
            .collect();
        let own = SocketAddr::new(self.proxy.into(), MTLS_IN_PORT);
        assignments.push(named("mtls-in", &load_assignment("mtls-in", &[own])));
        assignments
    }

    fn listeners(&self, state: &State) -> Vec<(String, Any)> {
        let at = |port| SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), port);
        let mut tcp = tcp_proxy_listener("tcp", at(TCP_PORT), "echo");
        let proxy = TcpProxy {
            stat_prefix: "tcp".into(),
            cluster_specifier: Some(ClusterSpecifier::Cluster("echo".into())),
            max_connect_attempts: Some(UInt32Value { value: 3 }),
            ..Default::default()
        };
        tcp.filter_chains[0].filters[0].config_type =
            Some(filter::ConfigType::TypedConfig(AdsServer::any(&proxy)));
        let mut mtls_in = http_listener(
            "mtls-in",
            SocketAddr::new(self.proxy.into(), MTLS_IN_PORT),
            "mtls-in",
        );
        mtls_in.filter_chains[0].transport_socket =
            Some(tls_socket(AdsServer::any(&DownstreamTlsContext {
                common_tls_context: Some(self.tls.common(&self.tls.server)),
                require_client_certificate: Some(BoolValue { value: true }),
                ..Default::default()
            })));
        let churn = state.churn_name();
        [
            http_listener("http", at(HTTP_PORT), "http"),
            tcp,
            http_listener("mtls-out", at(MTLS_OUT_PORT), "mtls-out"),
            mtls_in,
        ]
        .into_iter()
        .chain(
            state
                .churn_listener
                .then(|| http_listener(&churn, at(CHURN_PORT), &churn)),
        )
        .map(|l: Listener| {
            let name = l.name.clone();
            named(&name, &l)
        })
        .collect()
    }
}

fn routes(state: &State) -> Vec<(String, Any)> {
    let (a, b) = if state.heavy_b { (20, 80) } else { (80, 20) };
    let web_c = state.cluster_name("web-c");
    let mut split = vec![("web-a", a), ("web-b", b)];
    if state.route_c {
        split.push((web_c.as_str(), 20));
    }
    let churn = state.churn_name();
    let http = vec![
        route("/a", cluster("web-a")),
        route("/b", cluster("web-b")),
        route("/", weighted(&split)),
    ];
    [
        route_config("http", http),
        route_config("mtls-out", vec![route("/", cluster("mtls-in"))]),
        route_config("mtls-in", vec![route("/", cluster("web-a"))]),
    ]
    .into_iter()
    .chain(
        state
            .route_c
            .then(|| route_config(&churn, vec![route("/", cluster(&web_c))])),
    )
    .map(|r| {
        let name = r.name.clone();
        named(&name, &r)
    })
    .collect()
}

fn route_config(name: &str, routes: Vec<Route>) -> RouteConfiguration {
    RouteConfiguration {
        name: name.into(),
        virtual_hosts: vec![VirtualHost {
            name: format!("{name}-all"),
            domains: vec!["*".into()],
            routes,
            retry_policy: Some(RetryPolicy {
                retry_on: "connect-failure,refused-stream,reset".into(),
                num_retries: Some(UInt32Value { value: 2 }),
                ..Default::default()
            }),
            ..Default::default()
        }],
        ..Default::default()
    }
}

fn route(prefix: &str, to: route_action::ClusterSpecifier) -> Route {
    Route {
        r#match: Some(RouteMatch {
            path_specifier: Some(route_match::PathSpecifier::Prefix(prefix.into())),
            ..Default::default()
        }),
        action: Some(route::Action::Route(RouteAction {
            cluster_specifier: Some(to),
            ..Default::default()
        })),
        ..Default::default()
    }
}

fn cluster(name: &str) -> route_action::ClusterSpecifier {
    route_action::ClusterSpecifier::Cluster(name.into())
}

fn weighted(split: &[(&str, u32)]) -> route_action::ClusterSpecifier {
    route_action::ClusterSpecifier::WeightedClusters(WeightedCluster {
        clusters: split
            .iter()
            .map(|(name, weight)| ClusterWeight {
                name: (*name).into(),
                weight: Some(UInt32Value { value: *weight }),
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    })
}

/// `envoy.transport_sockets.tls` with `context` (an Upstream or DownstreamTlsContext).
fn tls_socket(context: Any) -> TransportSocket {
    TransportSocket {
        name: "envoy.transport_sockets.tls".into(),
        config_type: Some(transport_socket::ConfigType::TypedConfig(context)),
    }
}

fn inline(pem: &str) -> Option<DataSource> {
    Some(DataSource {
        specifier: Some(data_source::Specifier::InlineString(pem.into())),
        ..Default::default()
    })
}

/// A certificate chain and its key, PEM.
pub(crate) struct Identity {
    pub(crate) chain: String,
    pub(crate) key: String,
}

/// A CA and the two identities it signed, made with the `openssl` CLI in `dir` (kept
/// there for curl, removed at the end).
pub(crate) struct Tls {
    pub(crate) dir: PathBuf,
    ca: String,
    server: Identity,
    client: Identity,
}

impl Tls {
    pub(crate) fn new(dir: &Path) -> Result<Tls> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let openssl = |args: &[&str]| -> Result<()> {
            let out = Command::new("openssl")
                .args(args)
                .current_dir(dir)
                .output()
                .context("running openssl")?;
            ensure!(
                out.status.success(),
                "openssl {}: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr)
            );
            Ok(())
        };
        let new_key = [
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
        ];
        openssl(
            &[
                &["req", "-x509"][..],
                &new_key,
                &[
                    "-keyout",
                    "ca.key",
                    "-out",
                    "ca.pem",
                    "-days",
                    "2",
                    "-subj",
                    "/CN=shunt soak ca",
                    "-addext",
                    "basicConstraints=critical,CA:TRUE",
                    "-addext",
                    "keyUsage=critical,keyCertSign,cRLSign",
                ],
            ]
            .concat(),
        )?;
        let issue = |name: &str, sans: &str| -> Result<Identity> {
            let ext = format!("{name}.ext");
            std::fs::write(
                dir.join(&ext),
                format!(
                    "subjectAltName={sans}\nextendedKeyUsage=serverAuth,clientAuth\n\
                     basicConstraints=CA:FALSE\n"
                ),
            )?;
            let (key, csr, pem) = (
                format!("{name}.key"),
                format!("{name}.csr"),
                format!("{name}.pem"),
            );
            let subject = format!("/CN={name}");
            openssl(
                &[
                    &["req"][..],
                    &new_key,
                    &["-keyout", &key, "-out", &csr, "-subj", &subject],
                ]
                .concat(),
            )?;
            openssl(&[
                "x509",
                "-req",
                "-in",
                &csr,
                "-CA",
                "ca.pem",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-out",
                &pem,
                "-days",
                "2",
                "-extfile",
                &ext,
            ])?;
            Ok(Identity {
                chain: std::fs::read_to_string(dir.join(&pem))?,
                key: std::fs::read_to_string(dir.join(&key))?,
            })
        };
        let server = issue(
            "server",
            &format!("DNS:{SERVER_NAME},URI:spiffe://cluster.local/ns/default/sa/server"),
        )?;
        let client = issue("client", "URI:spiffe://cluster.local/ns/default/sa/client")?;
        Ok(Tls {
            dir: dir.to_owned(),
            ca: std::fs::read_to_string(dir.join("ca.pem"))?,
            server,
            client,
        })
    }

    /// `identity`'s certificate, and the CA to verify the peer with.
    fn common(&self, identity: &Identity) -> CommonTlsContext {
        CommonTlsContext {
            tls_certificates: vec![TlsCertificate {
                certificate_chain: inline(&identity.chain),
                private_key: inline(&identity.key),
                ..Default::default()
            }],
            validation_context_type: Some(ValidationContextType::ValidationContext(
                CertificateValidationContext {
                    trusted_ca: inline(&self.ca),
                    ..Default::default()
                },
            )),
            ..Default::default()
        }
    }

    /// A file of the folder (the client's certificate and key, the CA), for curl.
    pub(crate) fn file(&self, name: &str) -> String {
        self.dir.join(name).display().to_string()
    }
}
