//! `cargo xtask injection [--check]`: shunt's two sidecar-injection shapes, generated
//! from the one description below into `deploy/injection/`.
//!
//! - **native** (`shunt-sidecar-native.yaml`): `shunt agent` is an init container with
//!   `restartPolicy: Always` (Kubernetes' native sidecar) and a startupProbe on 15021
//!   `/healthz/ready`, so the kubelet starts what follows only once the proxy serves, and
//!   stops it last; its preStop hook drains inbound when pod termination starts.
//! - **classic** (`shunt-sidecar-classic.yaml`): for clusters without native sidecars,
//!   `shunt agent` is the first app container with the postStart hook `shunt agent wait`
//!   (Istio's holdApplicationUntilProxyStarts).
//!
//! What both share (the capture init container, the agent's command, environment,
//! ports, security context and volumes) is written once; each shape adds where the
//! agent goes and its hooks and probes. `tests/deploy_manifests.rs` includes this file,
//! checks the committed files are what it renders, and validates both against the
//! Kubernetes schemas of 1.28+ and of 1.27 (no native sidecars).

use std::path::{Path, PathBuf};

use serde_yaml_ng::{Mapping, Value};

/// The two shapes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    Native,
    Classic,
}

pub const SHAPES: [Shape; 2] = [Shape::Native, Shape::Classic];

impl Shape {
    pub fn file_name(self) -> &'static str {
        match self {
            Shape::Native => "shunt-sidecar-native.yaml",
            Shape::Classic => "shunt-sidecar-classic.yaml",
        }
    }

    /// Where the shape is committed, under the repository's root.
    pub fn path(self, root: &Path) -> PathBuf {
        root.join("deploy/injection").join(self.file_name())
    }
}

/// istio-init's job: capture the pod's traffic (eBPF, istio-iptables' rules as the
/// fallback), with istio-iptables' flags. NET_ADMIN for rules; BPF, PERFMON and
/// SYS_ADMIN for the eBPF programs.
const CAPTURE: &str = r#"
name: istio-init
image: ${SHUNT_IMAGE}
command: ["shunt"]
args: [capture, -p, "15001", -z, "15006", -u, "1337", -m, REDIRECT, -i, "*", -x, "", -b, "*", -d, "15090,15021,15020"]
securityContext:
  runAsUser: 0
  runAsGroup: 0
  runAsNonRoot: false
  allowPrivilegeEscalation: false
  readOnlyRootFilesystem: true
  capabilities:
    drop: ["ALL"]
    add: ["NET_ADMIN", "NET_RAW", "BPF", "PERFMON", "SYS_ADMIN"]
volumeMounts:
  - name: shunt-bpffs
    mountPath: /sys/fs/bpf
"#;

/// pilot-agent's job and the proxy's, in one process: `shunt agent`. Where it goes,
/// its hooks and its probes are the shape's.
const AGENT: &str = r#"
name: istio-proxy
image: ${SHUNT_IMAGE}
command: ["shunt"]
args: ["agent", "--xds-address", "${DISCOVERY_ADDRESS}"]
workingDir: /
ports:
  - name: http-envoy-prom
    containerPort: 15090
    protocol: TCP
  - name: status-port
    containerPort: 15021
    protocol: TCP
env:
  - name: POD_NAME
    valueFrom: {fieldRef: {fieldPath: metadata.name}}
  - name: POD_NAMESPACE
    valueFrom: {fieldRef: {fieldPath: metadata.namespace}}
  - name: INSTANCE_IP
    valueFrom: {fieldRef: {fieldPath: status.podIP}}
  - name: SERVICE_ACCOUNT
    valueFrom: {fieldRef: {fieldPath: spec.serviceAccountName}}
  - name: HOST_IP
    valueFrom: {fieldRef: {fieldPath: status.hostIP}}
  - name: CA_ADDR
    value: ${DISCOVERY_ADDRESS}
  - name: ISTIO_META_CLUSTER_ID
    value: ${CLUSTER_ID}
  - name: TRUST_DOMAIN
    value: ${TRUST_DOMAIN}
readinessProbe:
  httpGet: {path: /healthz/ready, port: 15021}
  periodSeconds: 15
  timeoutSeconds: 3
  failureThreshold: 4
securityContext:
  runAsUser: 1337
  runAsGroup: 1337
  runAsNonRoot: true
  allowPrivilegeEscalation: false
  readOnlyRootFilesystem: true
  capabilities:
    drop: ["ALL"]
resources:
  requests:
    cpu: 10m
    memory: 40Mi
volumeMounts:
  - {name: istio-envoy, mountPath: /etc/istio/proxy}
  - {name: istio-data, mountPath: /var/lib/istio/data}
  - {name: istio-podinfo, mountPath: /etc/istio/pod}
  - {name: istio-token, mountPath: /var/run/secrets/tokens}
  - {name: istiod-ca-cert, mountPath: /var/run/secrets/istio}
  - {name: workload-socket, mountPath: /var/run/secrets/workload-spiffe-uds}
  - {name: workload-certs, mountPath: /etc/certs}
"#;

/// Native: the kubelet runs the startupProbe (Istio's values: every second, for ten
/// minutes) before it starts the next container; the preStop hook runs when pod
/// termination starts and drains inbound (pilot-agent's `request POST drain`); the
/// SIGTERM that follows once the app's containers are gone then stops the agent at once.
const NATIVE: &str = r#"
restartPolicy: Always
startupProbe:
  httpGet: {path: /healthz/ready, port: 15021}
  initialDelaySeconds: 0
  periodSeconds: 1
  timeoutSeconds: 3
  failureThreshold: 600
lifecycle:
  preStop:
    exec:
      command: ["shunt", "agent", "request", "--debug-port", "15020", "POST", "drain"]
"#;

/// Classic: the kubelet starts containers in order and the next one only once a
/// postStart hook has returned, so `shunt agent wait` holds the app until the proxy is
/// ready. `SHUNT_EXIT_WHEN_APP_EXITS` is there to be switched on for Jobs.
const CLASSIC: &str = r#"
lifecycle:
  postStart:
    exec:
      command: ["shunt", "agent", "wait"]
env:
  - name: SHUNT_EXIT_WHEN_APP_EXITS
    value: "false"
"#;

const VOLUMES: &str = r#"
- name: shunt-bpffs
  hostPath: {path: /sys/fs/bpf, type: Directory}
- name: istio-envoy
  emptyDir: {medium: Memory}
- name: istio-data
  emptyDir: {}
- name: workload-socket
  emptyDir: {}
- name: workload-certs
  emptyDir: {}
- name: istio-podinfo
  downwardAPI:
    items:
      - {path: labels, fieldRef: {fieldPath: metadata.labels}}
      - {path: annotations, fieldRef: {fieldPath: metadata.annotations}}
- name: istio-token
  projected:
    sources:
      - serviceAccountToken: {audience: istio-ca, expirationSeconds: 43200, path: istio-token}
- name: istiod-ca-cert
  configMap: {name: istio-ca-root-cert}
"#;

const VARIABLES: &str = "\
# Substitute the ${...} variables (envsubst, or by hand):
#   SHUNT_IMAGE        the shunt image
#   DISCOVERY_ADDRESS  istiod, host:port (istiod.istio-system.svc:15012)
#   CLUSTER_ID         the mesh's cluster name (Kubernetes)
#   TRUST_DOMAIN       the mesh's trust domain (cluster.local)
";

const NATIVE_HEADER: &str = "\
# shunt's sidecar injection, native shape: Kubernetes 1.29+ (1.28 with the
# SidecarContainers feature gate). `shunt capture` (istio-init) runs first, then
# `shunt agent` (istio-proxy) starts as an init container with `restartPolicy: Always`:
# the kubelet starts the pod's own init containers and its app containers only once the
# agent's startupProbe (15021 /healthz/ready) passes, so they have the mesh from their
# first connection. At termination the preStop hook drains inbound, the app containers
# stop first and the agent last (it keeps serving their outbound, then exits 0 on its
# SIGTERM); a Job's pod completes when its app containers do.
#
# Merge into the pod's spec: `initContainers` go FIRST (before the pod's own),
# `volumes` are appended.
";

const CLASSIC_HEADER: &str = "\
# shunt's sidecar injection, classic shape: for clusters without native sidecars
# (before 1.28). `shunt capture` (istio-init) is the last init container, so the pod's
# own init containers run before capture (they reach the network, outside the mesh).
# `shunt agent` (istio-proxy) is the first app container; its postStart hook
# `shunt agent wait` holds the next containers until the proxy is ready
# (holdApplicationUntilProxyStarts). At termination every container gets SIGTERM at
# once: the agent stops inbound and serves outbound for TERMINATION_DRAIN_DURATION_SECONDS
# (or EXIT_ON_ZERO_ACTIVE_CONNECTIONS), then exits 0. For a Job, set
# `shareProcessNamespace: true` on the pod and SHUNT_EXIT_WHEN_APP_EXITS to \"true\": the
# agent then exits once the app's containers have (and on SIGTERM serves their outbound
# until then); or let the app end with `POST localhost:15020/quitquitquit`.
#
# Merge into the pod's spec: `initContainers` are appended (istio-init last),
# `containers` go FIRST (before the pod's own), `volumes` are appended.
";

/// The shape's file: a header saying what it is and how to use it, then the patch.
pub fn render(shape: Shape) -> String {
    let mut patch = Mapping::new();
    let mut agent = yaml(AGENT);
    let (header, extra) = match shape {
        Shape::Native => (NATIVE_HEADER, yaml(NATIVE)),
        Shape::Classic => (CLASSIC_HEADER, yaml(CLASSIC)),
    };
    merge(&mut agent, extra);
    match shape {
        Shape::Native => {
            patch.insert("initContainers".into(), vec![yaml(CAPTURE), agent].into());
        }
        Shape::Classic => {
            patch.insert("initContainers".into(), vec![yaml(CAPTURE)].into());
            patch.insert("containers".into(), vec![agent].into());
        }
    }
    patch.insert("volumes".into(), yaml(VOLUMES));
    let body = serde_yaml_ng::to_string(&Value::Mapping(patch)).expect("a YAML value");
    format!(
        "# Generated by `cargo xtask injection` from xtask/src/injection.rs: edit there.\n#\n\
         {header}{VARIABLES}{body}"
    )
}

/// Writes both shapes under `root`, or with `check` only says which differ from what
/// is committed.
pub fn write_all(root: &Path, check: bool) -> Result<(), String> {
    let mut stale = Vec::new();
    for shape in SHAPES {
        let path = shape.path(root);
        let text = render(shape);
        if std::fs::read_to_string(&path).ok().as_deref() == Some(text.as_str()) {
            continue;
        }
        if check {
            stale.push(path.display().to_string());
        } else {
            let written = path
                .parent()
                .map_or(Ok(()), std::fs::create_dir_all)
                .and_then(|()| std::fs::write(&path, text));
            written.map_err(|e| format!("writing {}: {e}", path.display()))?;
            println!("wrote {}", path.display());
        }
    }
    if stale.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "not what `cargo xtask injection` renders: {}",
            stale.join(", ")
        ))
    }
}

fn yaml(text: &str) -> Value {
    serde_yaml_ng::from_str(text).expect("the generator's own YAML")
}

/// Adds `extra`'s keys to `base`: lists are appended, maps merged, the rest set.
fn merge(base: &mut Value, extra: Value) {
    let (Value::Mapping(base), Value::Mapping(extra)) = (base, extra) else {
        panic!("merging YAML maps");
    };
    for (key, value) in extra {
        match (base.get_mut(&key), value) {
            (Some(Value::Sequence(list)), Value::Sequence(more)) => list.extend(more),
            (Some(existing @ Value::Mapping(_)), more @ Value::Mapping(_)) => merge(existing, more),
            (_, value) => {
                base.insert(key, value);
            }
        }
    }
}
