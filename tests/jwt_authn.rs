//! RequestAuthentication as istiod writes it, differential against Envoy 1.40: the
//! same bootstrap (but ports) served by `shunt proxy -c` and by Envoy in pod `proxy`,
//! the same requests from pod `client`, and the outcomes compared (status, body,
//! `www-authenticate`, the headers the echo backend saw, the filter's stats).
//!
//! `envoy.filters.http.jwt_authn` with an Istio-shaped provider (remote JWKS served
//! over HTTP by a test server, `requires_any[provider, allow_missing]`, audiences,
//! `forward_payload_header`, `claim_to_headers`, the payload in metadata with `scope`
//! space-delimited) and a second one with inline keys and tokens in a header, a query
//! parameter and a cookie; then Istio's RBAC reading the payload for
//! `requestPrincipals` and `request.auth.claims[groups]`. Tokens are RS256 (key from
//! openssl) and ES256, signed here with ring: valid, expired, not yet valid, wrong
//! issuer and audience, bad signature, unknown kid, garbled, oversized; a JWKS that
//! cannot be fetched.
//!
//! Needs root and Envoy (`cargo xtask setup`).

mod support;

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD as B64;
use harness::{Node, Pod, PodProcess, wait_for_port};
use ring::rand::SystemRandom;
use ring::signature::{self, KeyPair};
use serde_json::{Value, json};
use support::TempDir;
use support::curl::Response;
use support::envoy::socket_address;
use support::xds::admin_at;

const SHUNT_PORT: u16 = 10000;
const ENVOY_PORT: u16 = 11000;
const SHUNT_ADMIN: u16 = 15000;
const ENVOY_ADMIN: u16 = 15100;
const ECHO_PORT: u16 = 8081;
const JWKS_PORT: u16 = 8082;
/// Nothing listens there: JWKS fetches fail.
const JWKS_DOWN_PORT: u16 = 8089;
const ISSUER: &str = "https://issuer.test";
const LOCAL_ISSUER: &str = "local.test";

/// Echoes each request as JSON: its path and headers (lowercase names, every value).
const ECHO_SERVER: &str = r#"
import json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
class Echo(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_GET(self):
        seen = {}
        for k, v in self.headers.items():
            seen.setdefault(k.lower(), []).append(v)
        out = json.dumps({"path": self.path, "headers": seen}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)
    do_OPTIONS = do_GET
    def log_message(self, *args):
        pass
ThreadingHTTPServer(("0.0.0.0", int(sys.argv[1])), Echo).serve_forever()
"#;

/// The signing keys and their JWKS.
struct Keys {
    rsa: signature::RsaKeyPair,
    ec: signature::EcdsaKeyPair,
    rng: SystemRandom,
}

impl Keys {
    fn new(dir: &std::path::Path) -> Keys {
        // ring reads RSA private keys as PKCS#1 DER (`-traditional`).
        let (pem, der) = (dir.join("rsa.pem"), dir.join("rsa.der"));
        let openssl = |args: &[&std::ffi::OsStr]| {
            let out = std::process::Command::new("openssl")
                .args(args)
                .output()
                .expect("run openssl");
            assert!(out.status.success(), "openssl {args:?}: {out:?}");
        };
        openssl(&[
            "genpkey".as_ref(),
            "-algorithm".as_ref(),
            "RSA".as_ref(),
            "-out".as_ref(),
            pem.as_os_str(),
        ]);
        openssl(&[
            "rsa".as_ref(),
            "-in".as_ref(),
            pem.as_os_str(),
            "-traditional".as_ref(),
            "-outform".as_ref(),
            "DER".as_ref(),
            "-out".as_ref(),
            der.as_os_str(),
        ]);
        let rsa = signature::RsaKeyPair::from_der(&std::fs::read(&der).unwrap()).unwrap();
        let rng = SystemRandom::new();
        let alg = &signature::ECDSA_P256_SHA256_FIXED_SIGNING;
        let pkcs8 = signature::EcdsaKeyPair::generate_pkcs8(alg, &rng).unwrap();
        let ec = signature::EcdsaKeyPair::from_pkcs8(alg, pkcs8.as_ref(), &rng).unwrap();
        Keys { rsa, ec, rng }
    }

    fn jwks(&self) -> Value {
        let public: signature::RsaPublicKeyComponents<Vec<u8>> = self.rsa.public().into();
        let point = self.ec.public_key().as_ref();
        json!({"keys": [
            {"kty": "RSA", "kid": "rsa1", "alg": "RS256", "use": "sig",
             "n": B64.encode(&public.n),
             "e": B64.encode(&public.e)},
            {"kty": "EC", "crv": "P-256", "kid": "ec1",
             "x": B64.encode(&point[1..33]), "y": B64.encode(&point[33..])}
        ]})
    }

    fn sign(&self, header: Value, payload: Value) -> String {
        let signed = format!(
            "{}.{}",
            B64.encode(header.to_string()),
            B64.encode(payload.to_string())
        );
        let signature = match header["alg"].as_str() {
            Some("ES256") => self
                .ec
                .sign(&self.rng, signed.as_bytes())
                .unwrap()
                .as_ref()
                .to_vec(),
            _ => {
                let mut sig = vec![0; self.rsa.public().modulus_len()];
                self.rsa
                    .sign(
                        &signature::RSA_PKCS1_SHA256,
                        &self.rng,
                        signed.as_bytes(),
                        &mut sig,
                    )
                    .unwrap();
                sig
            }
        };
        format!("{signed}.{}", B64.encode(signature))
    }

    fn rs256(&self, payload: Value) -> String {
        self.sign(
            json!({"alg": "RS256", "kid": "rsa1", "typ": "JWT"}),
            payload,
        )
    }
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

fn claims(sub: &str, extra: Value) -> Value {
    let mut c = json!({"iss": ISSUER, "sub": sub, "aud": ["api.test"], "iat": now(),
        "exp": now() + 3600, "groups": ["admins", "dev"], "scope": "read write"});
    for (k, v) in extra.as_object().unwrap() {
        c[k] = v.clone();
    }
    c
}

fn typed(type_name: &str, mut config: Value) -> Value {
    config["@type"] = json!(format!("type.googleapis.com/{type_name}"));
    config
}

fn cluster(name: &str, at: SocketAddr) -> Value {
    json!({
        "name": name, "type": "STATIC", "connect_timeout": "1s",
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": socket_address(at.ip(), at.port())}}
        ]}]}
    })
}

fn remote_jwks(cluster: &str, port: u16) -> Value {
    json!({"http_uri": {"uri": format!("http://jwks.test:{port}/jwks.json"),
        "cluster": cluster, "timeout": "2s"}, "cache_duration": "300s"})
}

/// Istio's provider for a JWTRule (pilot/pkg/security/authn/policy_applier.go).
fn istio_provider(remote: Value, extra: Value) -> Value {
    let mut p = json!({
        "issuer": ISSUER, "audiences": ["api.test", "other.test"],
        "remote_jwks": remote,
        "forward_payload_header": "x-jwt-payload",
        "claim_to_headers": [{"header_name": "x-jwt-sub", "claim_name": "sub"},
                             {"header_name": "x-jwt-groups", "claim_name": "groups"}],
        "payload_in_metadata": "payload",
        "normalize_payload_in_metadata": {"space_delimited_claims": ["scope", "permission"]}
    });
    for (k, v) in extra.as_object().unwrap() {
        p[k] = v.clone();
    }
    p
}

fn requires_any_or_missing(provider: &str) -> Value {
    json!({"requires_any": {"requirements": [{"provider_name": provider}, {"allow_missing": {}}]}})
}

/// Istio's RBAC principal for `requestPrincipals` and `request.auth.claims[groups]`
/// (pilot/pkg/security/authz/model/generator.go).
fn istio_rbac() -> Value {
    let claim = |key: &str, exact: &str| {
        json!({"metadata": {
        "filter": "envoy.filters.http.jwt_authn",
        "path": [{"key": "payload"}, {"key": key}],
        "value": {"string_match": {"exact": exact}}}})
    };
    let groups = json!({"metadata": {
        "filter": "envoy.filters.http.jwt_authn",
        "path": [{"key": "payload"}, {"key": "groups"}],
        "value": {"or_match": {"value_matchers": [
            {"list_match": {"one_of": {"string_match": {"exact": "admins"}}}},
            {"string_match": {"exact": "admins"}}]}}}});
    let authz_path = json!({"url_path": {"path": {"prefix": "/authz"}}});
    json!({"name": "envoy.filters.http.rbac", "typed_config": typed(
    "envoy.extensions.filters.http.rbac.v3.RBAC", json!({"rules": {"policies": {
        "ns[default]-policy[public]-rule[0]": {
            "permissions": [{"not_rule": authz_path}], "principals": [{"any": true}]},
        "ns[default]-policy[admins]-rule[0]": {
            "permissions": [{"and_rules": {"rules": [{"or_rules": {"rules": [authz_path]}}]}}],
            "principals": [{"and_ids": {"ids": [
                {"or_ids": {"ids": [{"and_ids": {"ids": [claim("iss", ISSUER), claim("sub", "alice")]}}]}},
                {"or_ids": {"ids": [groups]}}
            ]}}]}
    }}}))})
}

fn jwt_filter(jwks: &Value) -> Value {
    let local = json!({
        "issuer": LOCAL_ISSUER,
        "local_jwks": {"inline_string": jwks.to_string()},
        "from_headers": [{"name": "x-jwt"}],
        "from_params": ["token"],
        "from_cookies": ["jwt"],
        "forward": true,
        "payload_in_metadata": "local"
    });
    let rule =
        |prefix: &str, requires: Value| json!({"match": {"prefix": prefix}, "requires": requires});
    json!({"name": "envoy.filters.http.jwt_authn", "typed_config": typed(
    "envoy.extensions.filters.http.jwt_authn.v3.JwtAuthentication", json!({
        "providers": {
            "origins-0": istio_provider(remote_jwks("jwks", JWKS_PORT), json!({})),
            "down": istio_provider(remote_jwks("jwks_down", JWKS_DOWN_PORT), json!({})),
            "local": local
        },
        "rules": [
            {"match": {"prefix": "/open"}},
            rule("/strict", json!({"provider_name": "origins-0"})),
            rule("/local", json!({"provider_name": "local"})),
            rule("/down", json!({"provider_name": "down"})),
            rule("/audience", json!({"provider_and_audiences":
                {"provider_name": "origins-0", "audiences": ["special.test"]}})),
            rule("/", requires_any_or_missing("origins-0"))
        ],
        "bypass_cors_preflight": true
    }))})
}

fn bootstrap(port: u16, admin: u16, backends: Ipv4Addr, jwks: &Value) -> Value {
    let at = |port| SocketAddr::new(backends.into(), port);
    let hcm = json!({"name": "envoy.filters.network.http_connection_manager", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "authn",
        "codec_type": "AUTO",
        "http_filters": [jwt_filter(jwks), istio_rbac(), {"name": "envoy.filters.http.router",
            "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}],
        "route_config": {"name": "authn", "virtual_hosts": [{"name": "all", "domains": ["*"],
            "routes": [{"match": {"prefix": "/"}, "route": {"cluster": "backend"}}]}]}
    }});
    json!({
        "node": {"id": "authn-test", "cluster": "authn-test"},
        "admin": {"address": socket_address("127.0.0.1", admin)},
        "static_resources": {
            "listeners": [{"name": "main", "address": socket_address("0.0.0.0", port),
                           "filter_chains": [{"filters": [hcm]}]}],
            "clusters": [
                cluster("backend", at(ECHO_PORT)),
                cluster("jwks", at(JWKS_PORT)),
                cluster("jwks_down", at(JWKS_DOWN_PORT))
            ]
        }
    })
}

struct Scene {
    _node: Node,
    proxy_pod: Pod,
    client: Pod,
    shunt: PodProcess,
    envoy: PodProcess,
    _backends: Vec<PodProcess>,
    _dir: TempDir,
    keys: Keys,
}

impl Scene {
    fn new() -> Scene {
        let mut node = Node::new().expect("node");
        let proxy_pod = node.add_pod("proxy").expect("pod proxy");
        let backends = node.add_pod("backends").expect("pod backends");
        let client = node.add_pod("client").expect("pod client");
        let dir = TempDir::new("jwt-authn");
        let keys = Keys::new(&dir.0);
        let jwks = keys.jwks();
        let served = dir.0.join("served");
        std::fs::create_dir_all(&served).unwrap();
        std::fs::write(served.join("jwks.json"), jwks.to_string()).unwrap();
        let echo = backends
            .command("/usr/bin/python3")
            .args(["-c", ECHO_SERVER, &ECHO_PORT.to_string()])
            .spawn()
            .expect("start the echo server");
        let jwks_server = backends
            .command("/usr/bin/python3")
            .args([
                "-m",
                "http.server",
                &JWKS_PORT.to_string(),
                "--bind",
                "0.0.0.0",
            ])
            .arg("--directory")
            .arg(&served)
            .spawn()
            .expect("start the JWKS server");
        for (port, process) in [(ECHO_PORT, &echo), (JWKS_PORT, &jwks_server)] {
            wait_for_port(
                &backends,
                SocketAddr::from(([127, 0, 0, 1], port)),
                Duration::from_secs(20),
            )
            .unwrap_or_else(|e| panic!("backend port {port}: {e}\n{}", process.stderr_text()));
        }
        let write = |name: &str, config: Value| {
            let file = dir.0.join(name);
            std::fs::write(&file, serde_json::to_vec_pretty(&config).unwrap()).unwrap();
            file
        };
        let shunt_config = write(
            "shunt.json",
            bootstrap(SHUNT_PORT, SHUNT_ADMIN, backends.ipv4(), &jwks),
        );
        let envoy_config = write(
            "envoy.json",
            bootstrap(ENVOY_PORT, ENVOY_ADMIN, backends.ipv4(), &jwks),
        );
        let (shunt, envoy) = support::envoy::start_side_by_side(
            &proxy_pod,
            &shunt_config,
            &envoy_config,
            [SHUNT_PORT, ENVOY_PORT],
        );
        Scene {
            _node: node,
            proxy_pod,
            client,
            shunt,
            envoy,
            _backends: vec![echo, jwks_server],
            _dir: dir,
            keys,
        }
    }

    /// curl from the client pod: status, headers, body.
    fn curl(&self, port: u16, path: &str, args: &[String]) -> Response {
        let url = format!("http://{}:{port}{path}", self.proxy_pod.ipv4());
        let out = self
            .client
            .command("curl")
            .args(["-s", "-S", "-i", "--max-time", "10"])
            .args(args)
            .arg(&url)
            .output()
            .expect("run curl");
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "curl {url} failed: {}{text}\nshunt: {}",
            String::from_utf8_lossy(&out.stderr),
            self.shunt.stderr_text()
        );
        Response::parse(&text)
    }
}

/// The request headers the backend saw that are compared.
const COMPARED_UPSTREAM: &[&str] = &[
    "authorization",
    "x-jwt",
    "cookie",
    "x-jwt-payload",
    "x-jwt-sub",
    "x-jwt-groups",
];

fn outcome(r: &Response, port: u16) -> Value {
    let body = match serde_json::from_str::<Value>(&r.body) {
        Ok(echo) if echo.get("headers").is_some() => {
            let seen: BTreeMap<_, _> = COMPARED_UPSTREAM
                .iter()
                .filter_map(|h| Some((*h, echo["headers"].get(*h)?.clone())))
                .collect();
            json!({"upstream_path": echo["path"], "upstream_headers": seen})
        }
        _ => json!(r.body),
    };
    // The realm names the proxy's own address: its port differs.
    let challenge = r
        .headers
        .get("www-authenticate")
        .map(|v| v.replace(&format!(":{port}/"), ":PORT/"));
    json!({"status": r.status, "www-authenticate": challenge, "body": body})
}

/// The jwt_authn and RBAC counters that are not zero.
fn filter_stats(pod: &Pod, admin: u16) -> BTreeMap<String, u64> {
    let (status, body) = admin_at(pod, &format!("127.0.0.1:{admin}"), "/stats?format=json");
    assert_eq!(status, 200, "{body}");
    let stats: Value = serde_json::from_str(&body).unwrap();
    stats["stats"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|s| Some((s["name"].as_str()?.to_owned(), s["value"].as_u64()?)))
        .filter(|(name, value)| {
            *value > 0 && (name.contains(".jwt_authn.") || name.starts_with("http.authn.rbac."))
        })
        .collect()
}

struct Case {
    name: &'static str,
    path: String,
    args: Vec<String>,
    /// What Envoy is expected to answer, so a table that changes nothing cannot pass.
    status: u16,
}

fn bearer(token: &str) -> Vec<String> {
    vec!["-H".into(), format!("authorization: Bearer {token}")]
}

fn cases(k: &Keys) -> Vec<Case> {
    let case = |name, path: &str, args: Vec<String>, status| Case {
        name,
        path: path.to_owned(),
        args,
        status,
    };
    let alice = k.rs256(claims("alice", json!({})));
    let bob = k.rs256(claims("bob", json!({})));
    let es = k.sign(
        json!({"alg": "ES256", "kid": "ec1"}),
        claims("carol", json!({})),
    );
    let expired = k.rs256(claims("alice", json!({"exp": now() - 600})));
    let early = k.rs256(claims("alice", json!({"nbf": now() + 600})));
    let wrong_aud = k.rs256(claims("alice", json!({"aud": "nobody.test"})));
    let wrong_iss = k.rs256(claims("alice", json!({"iss": "https://evil.test"})));
    let no_kid = k.sign(
        json!({"alg": "RS256", "kid": "rsa9"}),
        claims("alice", json!({})),
    );
    let mut bad_sig = alice.clone();
    bad_sig.replace_range(bad_sig.len() - 6.., "AAAAAA");
    let local = k.rs256(claims("dave", json!({"iss": LOCAL_ISSUER})));
    let huge = format!("{}.{}.x", "e".repeat(4000), "f".repeat(4000));
    vec![
        case("no rule requirement", "/open", vec![], 200),
        case("istio: no token", "/", vec![], 200),
        case("istio: valid RS256", "/", bearer(&alice), 200),
        case("istio: valid ES256", "/", bearer(&es), 200),
        case(
            "istio: token in access_token",
            &format!("/?access_token={alice}"),
            vec![],
            200,
        ),
        case("istio: expired", "/", bearer(&expired), 401),
        case("istio: not yet valid", "/", bearer(&early), 401),
        case("istio: wrong audience", "/", bearer(&wrong_aud), 403),
        case("istio: wrong issuer", "/", bearer(&wrong_iss), 401),
        case("istio: bad signature", "/", bearer(&bad_sig), 401),
        case("istio: unknown kid", "/", bearer(&no_kid), 401),
        case("istio: garbled", "/", bearer("abc.def"), 401),
        case("istio: huge", "/", bearer(&huge), 401),
        case(
            "istio: cors preflight",
            "/",
            vec![
                "-X".into(),
                "OPTIONS".into(),
                "-H".into(),
                "origin: https://a.test".into(),
                "-H".into(),
                "access-control-request-method: GET".into(),
            ],
            200,
        ),
        case("provider: no token", "/strict", vec![], 401),
        case("provider: valid", "/strict", bearer(&bob), 200),
        case(
            "provider_and_audiences: other audience",
            "/audience",
            bearer(&alice),
            403,
        ),
        case(
            "local: header",
            "/local",
            vec!["-H".into(), format!("x-jwt: {local}")],
            200,
        ),
        case(
            "local: param",
            &format!("/local?token={local}"),
            vec![],
            200,
        ),
        case(
            "local: cookie",
            "/local",
            vec!["-H".into(), format!("cookie: a=b; jwt={local}")],
            200,
        ),
        case(
            "local: other issuer's token",
            "/local",
            vec!["-H".into(), format!("x-jwt: {alice}")],
            401,
        ),
        case("remote JWKS down", "/down", bearer(&alice), 401),
        case(
            "rbac: requestPrincipal alice",
            "/authz",
            bearer(&alice),
            200,
        ),
        case("rbac: requestPrincipal bob", "/authz", bearer(&bob), 403),
        case("rbac: no token", "/authz", vec![], 403),
    ]
}

#[test]
fn request_authentication_answers_as_envoy_does() {
    let s = Scene::new();
    let mut differences = Vec::new();
    for c in cases(&s.keys) {
        let envoy = s.curl(ENVOY_PORT, &c.path, &c.args);
        let shunt = s.curl(SHUNT_PORT, &c.path, &c.args);
        assert_eq!(
            envoy.status, c.status,
            "{}: Envoy answered {envoy:?}; the case expects {}",
            c.name, c.status
        );
        let (theirs, ours) = (outcome(&envoy, ENVOY_PORT), outcome(&shunt, SHUNT_PORT));
        if theirs != ours {
            differences.push(format!("{}:\n  envoy {theirs}\n  shunt {ours}", c.name));
        }
    }
    let mut envoy_stats = filter_stats(&s.proxy_pod, ENVOY_ADMIN);
    let mut shunt_stats = filter_stats(&s.proxy_pod, SHUNT_ADMIN);
    // Envoy caches keys per worker (one fetch each) and counts its verified-token
    // cache, which shunt does not have; shunt's one key cache fetches once.
    let fetched = "http.authn.jwt_authn.jwks_fetch_success";
    assert_eq!(
        shunt_stats.remove(fetched),
        Some(1),
        "shunt fetched the JWKS once"
    );
    envoy_stats.retain(|name, _| name != fetched && !name.contains(".jwt_cache_"));
    assert!(
        envoy_stats.contains_key("http.authn.jwt_authn.allowed"),
        "Envoy's stats lack the filter's: {envoy_stats:?}"
    );
    if envoy_stats != shunt_stats {
        differences.push(format!(
            "filter stats:\n  envoy {envoy_stats:?}\n  shunt {shunt_stats:?}"
        ));
    }
    assert!(
        differences.is_empty(),
        "{} differences from Envoy:\n{}\nshunt stderr:\n{}\nenvoy stderr:\n{}",
        differences.len(),
        differences.join("\n"),
        s.shunt.stderr_text(),
        s.envoy.stderr_text()
    );
}
