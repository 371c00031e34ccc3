//! `deploy/`: the manifests validate offline against Kubernetes' OpenAPI schemas
//! (kubernetes-validate from PyPI, strict: unknown fields are errors); the two
//! injection shapes are what `cargo xtask injection` renders, each merged into a pod
//! validates (the native one from 1.28 on, the classic one on 1.27 too), and the
//! commands the manifests run are ones the `shunt` binary accepts.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use harness::shunt_bin;
use serde_json::{Value, json};

#[allow(dead_code)]
#[path = "../xtask/src/injection.rs"]
mod injection;

use injection::Shape;

/// The Kubernetes version the manifests target.
const KUBERNETES: &str = "1.33.0";
/// The first with native sidecars in its API (`restartPolicy` on a container).
const NATIVE_SIDECARS: &str = "1.28.0";
/// The last without.
const BEFORE_NATIVE_SIDECARS: &str = "1.27.0";

fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy")
}

/// Runs kubernetes-validate (installed by `cargo xtask setup`) on `files` for the
/// targeted Kubernetes: (success, output).
fn validate(files: &[PathBuf]) -> (bool, String) {
    validate_for(files, KUBERNETES)
}

fn validate_for(files: &[PathBuf], kubernetes: &str) -> (bool, String) {
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or("/root".into());
    let dir = home.join(".cache/shunt/kubernetes-validate");
    let python = std::fs::read_to_string(dir.join("python")).unwrap_or_else(|e| {
        panic!(
            "kubernetes-validate is not installed in {} ({e}): run `cargo xtask setup`",
            dir.display()
        )
    });
    let out = Command::new(python.trim())
        .args([
            "-m",
            "kubernetes_validate",
            "--strict",
            "--no-warn",
            "-k",
            kubernetes,
        ])
        .args(files)
        .env("PYTHONPATH", &dir)
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Scratch {
        let dir = std::env::temp_dir().join(format!("shunt-deploy-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn yaml_docs(path: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(path).unwrap();
    serde_yaml_ng::Deserializer::from_str(&text)
        .map(|doc| serde::Deserialize::deserialize(doc).unwrap())
        .collect()
}

#[test]
fn the_manifests_validate_against_the_kubernetes_schemas() {
    let files: Vec<PathBuf> = [
        "serviceaccount.yaml",
        "rbac.yaml",
        "daemonset.yaml",
        "uninstall.yaml",
    ]
    .iter()
    .map(|f| deploy_dir().join(f))
    .collect();
    let (ok, out) = validate(&files);
    assert!(ok, "{out}");

    // The validator is strict: a misspelt field fails (so the pass above means something).
    let scratch = Scratch::new("typo");
    let typo = scratch.0.join("typo.yaml");
    let text = std::fs::read_to_string(deploy_dir().join("daemonset.yaml")).unwrap();
    std::fs::write(&typo, text.replace("hostNetwork:", "hostNetwrk:")).unwrap();
    let (ok, out) = validate(&[typo]);
    assert!(!ok, "a misspelt field passed: {out}");
    assert!(out.contains("hostNetwrk"), "{out}");
}

#[test]
fn the_daemonset_mounts_what_node_mode_needs() {
    let ds = &yaml_docs(&deploy_dir().join("daemonset.yaml"))[0];
    let spec = &ds["spec"]["template"]["spec"];
    assert_eq!(spec["hostNetwork"], true);
    assert_eq!(spec["hostPID"], true);
    let host_paths: Vec<&str> = spec["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|v| v["hostPath"]["path"].as_str())
        .collect();
    for needed in [
        "/sys/fs/bpf",
        "/sys/fs/cgroup",
        "/var/run/netns",
        "/opt/cni/bin",
        "/etc/cni/net.d",
    ] {
        assert!(
            host_paths.contains(&needed),
            "{needed} not mounted: {host_paths:?}"
        );
    }
    assert_eq!(spec["containers"][0]["securityContext"]["privileged"], true);
}

/// The init container's install step, run as written in the manifest (its `/host`
/// paths moved under a scratch directory): the plugin is copied and chained.
#[test]
fn the_install_step_as_written_chains_the_plugin() {
    let ds = &yaml_docs(&deploy_dir().join("daemonset.yaml"))[0];
    let init = &ds["spec"]["template"]["spec"]["initContainers"][0];
    let scratch = Scratch::new("install");
    let host = scratch.0.to_str().unwrap();
    std::fs::create_dir_all(scratch.0.join("etc/cni/net.d")).unwrap();
    let conflist = scratch.0.join("etc/cni/net.d/10-bridge.conflist");
    std::fs::write(
        &conflist,
        json!({"cniVersion": "1.0.0", "name": "k8s", "plugins": [{"type": "bridge"}]}).to_string(),
    )
    .unwrap();
    let args: Vec<String> = init["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap().replace("=/host", &format!("={host}")))
        .collect();
    let out = Command::new(shunt_bin()).args(&args).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(scratch.0.join("opt/cni/bin/shunt-cni").is_file());
    let list: Value = serde_json::from_str(&std::fs::read_to_string(&conflist).unwrap()).unwrap();
    assert_eq!(list["plugins"][1]["type"], "shunt-cni");
    assert_eq!(
        list["plugins"][1]["agent_socket"],
        "/var/run/shunt/cni.sock"
    );
    assert_eq!(
        list["plugins"][1]["exclude_namespaces"],
        json!(["kube-system", "istio-system"])
    );
}

/// The agent's command line, run as written (its host paths moved under a scratch
/// directory, the pods' cgroup one that does not exist): `shunt` accepts every flag and
/// parses the DNS capture (the resolvers from resolv.conf) before it stops at the
/// missing cgroup, so the manifest's flags are ones the binary takes.
#[test]
fn the_daemonset_runs_the_node_agent_with_dns_capture() {
    let ds = &yaml_docs(&deploy_dir().join("daemonset.yaml"))[0];
    let container = &ds["spec"]["template"]["spec"]["containers"][0];
    let args: Vec<&str> = container["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    assert_eq!(args[0], "node");
    assert!(args.contains(&"--redirect-dns"), "{args:?}");
    // Upgrades: the new pod starts first and takes the node over.
    assert!(args.contains(&"--take-over"), "{args:?}");
    let rolling = &ds["spec"]["updateStrategy"]["rollingUpdate"];
    assert_eq!(rolling["maxSurge"], 1, "{rolling:?}");
    assert_eq!(rolling["maxUnavailable"], 0, "{rolling:?}");
    assert!(
        args.iter().any(|a| a.starts_with("--cgroup=")),
        "the capture needs the pods' parent cgroup: {args:?}"
    );

    let scratch = Scratch::new("agent");
    let root = scratch.0.to_str().unwrap();
    let moved: Vec<String> = args
        .iter()
        .map(|a| {
            a.replace("=/var/", &format!("={root}/var/"))
                .replace("=/run/", &format!("={root}/run/"))
                .replace("=/sys/fs/cgroup/", &format!("={root}/cgroup/"))
        })
        .collect();
    let out = Command::new(shunt_bin())
        .args(&moved)
        .arg(format!("--bpffs={root}/bpf"))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains(&format!("--cgroup {root}/cgroup/")),
        "stopped before the capture: {stderr}"
    );
}

/// `${NAME}` replaced from `vars`; an unknown name is an error.
fn render(template: &str, vars: &BTreeMap<&str, &str>) -> Result<String, String> {
    let mut out = String::new();
    let mut rest = template;
    while let Some(start) = rest.find("${") {
        out.push_str(&rest[..start]);
        let end = rest[start..].find('}').ok_or("an unclosed ${")? + start;
        let name = &rest[start + 2..end];
        out.push_str(vars.get(name).ok_or(format!("unknown variable {name}"))?);
        rest = &rest[end + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

fn committed(shape: Shape) -> String {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    std::fs::read_to_string(shape.path(&root)).unwrap()
}

/// The shape's patch with its variables substituted.
fn patch(shape: Shape) -> Value {
    let vars = BTreeMap::from([
        ("SHUNT_IMAGE", "ghcr.io/shunt/shunt:0.1.0"),
        ("DISCOVERY_ADDRESS", "istiod.istio-system.svc:15012"),
        ("CLUSTER_ID", "Kubernetes"),
        ("TRUST_DOMAIN", "cluster.local"),
    ]);
    // Comments name the variables too: render only the YAML.
    let body: String = committed(shape)
        .lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .map(|l| format!("{l}\n"))
        .collect();
    assert!(
        render(&body, &BTreeMap::new()).is_err(),
        "the template has variables"
    );
    serde_yaml_ng::from_str(&render(&body, &vars).unwrap()).unwrap()
}

/// A Deployment's pod with an init container of its own, injected as the shape's
/// header says: native, the injected init containers first; classic, the injected
/// init container last and the agent first among the containers.
fn injected_pod(shape: Shape) -> Value {
    let patch = patch(shape);
    let mut pod = json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "reviews-v1-0", "namespace": "bookinfo", "labels": {"app": "reviews"}},
        "spec": {
            "serviceAccountName": "bookinfo-reviews",
            "initContainers": [{"name": "migrate", "image": "docker.io/library/busybox:1.37",
                                "command": ["wget", "-qO-", "http://schema-registry:8080/"]}],
            "containers": [{"name": "reviews", "image": "docker.io/istio/examples-bookinfo-reviews-v1:1.20.1",
                            "ports": [{"containerPort": 9080}]}]
        }
    });
    let spec = pod["spec"].as_object_mut().unwrap();
    let first = |list: &str| {
        matches!(
            (shape, list),
            (Shape::Native, "initContainers") | (Shape::Classic, "containers")
        )
    };
    for list in ["initContainers", "containers", "volumes"] {
        let injected = patch[list].as_array().cloned().unwrap_or_default();
        let own = spec
            .get(list)
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default();
        let merged: Vec<Value> = if first(list) {
            injected.into_iter().chain(own).collect()
        } else {
            own.into_iter().chain(injected).collect()
        };
        spec.insert(list.into(), Value::Array(merged));
    }
    pod
}

fn names(list: &Value) -> Vec<&str> {
    list.as_array()
        .unwrap()
        .iter()
        .map(|c| c["name"].as_str().unwrap())
        .collect()
}

/// A hook's command with `--help` added: shunt parses the flags it names and stops
/// there, so a misspelt subcommand or flag fails here.
fn shunt_accepts(command: &Value) {
    let argv: Vec<&str> = command
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    assert_eq!(argv[0], "shunt", "{argv:?}");
    let out = Command::new(shunt_bin())
        .args(&argv[1..])
        .arg("--help")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{argv:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn the_committed_injection_shapes_are_what_the_generator_renders() {
    for shape in injection::SHAPES {
        assert!(
            committed(shape) == injection::render(shape),
            "deploy/injection/{} is not what xtask/src/injection.rs renders: run \
             `cargo xtask injection`",
            shape.file_name()
        );
    }
}

#[test]
fn both_shapes_make_valid_pods_from_native_sidecars_on_and_only_classic_before() {
    let scratch = Scratch::new("inject");
    let write = |shape: Shape| {
        let file = scratch.0.join(shape.file_name());
        let pod = injected_pod(shape);
        std::fs::write(&file, serde_json::to_string_pretty(&pod).unwrap()).unwrap();
        file
    };
    let native = write(Shape::Native);
    let classic = write(Shape::Classic);
    for kubernetes in [NATIVE_SIDECARS, KUBERNETES] {
        let (ok, out) = validate_for(&[native.clone(), classic.clone()], kubernetes);
        assert!(ok, "Kubernetes {kubernetes}: {out}");
    }
    // 1.27 has no native sidecars: the classic shape is for it, and the native one is
    // refused naming the field (a lenient API server would drop it, leaving an init
    // container that never ends).
    let (ok, out) = validate_for(&[classic], BEFORE_NATIVE_SIDECARS);
    assert!(ok, "classic on {BEFORE_NATIVE_SIDECARS}: {out}");
    let (ok, out) = validate_for(&[native], BEFORE_NATIVE_SIDECARS);
    assert!(!ok, "native passed on {BEFORE_NATIVE_SIDECARS}: {out}");
    assert!(out.contains("restartPolicy"), "{out}");
}

#[test]
fn the_native_shape_starts_the_agent_before_the_pods_own_init_containers() {
    let pod = injected_pod(Shape::Native);
    let spec = &pod["spec"];
    assert_eq!(
        names(&spec["initContainers"]),
        ["istio-init", "istio-proxy", "migrate"]
    );
    assert_eq!(names(&spec["containers"]), ["reviews"]);
    let agent = &spec["initContainers"][1];
    assert_eq!(agent["restartPolicy"], "Always");
    let startup = &agent["startupProbe"]["httpGet"];
    assert_eq!(startup["path"], "/healthz/ready");
    assert_eq!(startup["port"], 15021);
    let pre_stop = &agent["lifecycle"]["preStop"]["exec"]["command"];
    assert_eq!(
        pre_stop,
        &json!([
            "shunt",
            "agent",
            "request",
            "--debug-port",
            "15020",
            "POST",
            "drain"
        ])
    );
    shunt_accepts(pre_stop);
    assert!(agent["lifecycle"]["postStart"].is_null());
}

#[test]
fn the_classic_shape_holds_the_app_until_the_agent_is_ready() {
    let pod = injected_pod(Shape::Classic);
    let spec = &pod["spec"];
    // The pod's own init container runs before capture; the agent starts first.
    assert_eq!(names(&spec["initContainers"]), ["migrate", "istio-init"]);
    assert_eq!(names(&spec["containers"]), ["istio-proxy", "reviews"]);
    let agent = &spec["containers"][0];
    assert!(agent["restartPolicy"].is_null());
    let post_start = &agent["lifecycle"]["postStart"]["exec"]["command"];
    assert_eq!(post_start, &json!(["shunt", "agent", "wait"]));
    shunt_accepts(post_start);
    let env: Vec<&str> = agent["env"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["name"].as_str().unwrap())
        .collect();
    assert!(env.contains(&"SHUNT_EXIT_WHEN_APP_EXITS"), "{env:?}");
}

#[test]
fn both_shapes_run_the_agent_and_capture_as_shunt_accepts_them() {
    for shape in injection::SHAPES {
        let patch = patch(shape);
        let agent = match shape {
            Shape::Native => &patch["initContainers"][1],
            Shape::Classic => &patch["containers"][0],
        };
        assert_eq!(agent["name"], "istio-proxy");
        assert_eq!(
            agent["args"],
            json!(["agent", "--xds-address", "istiod.istio-system.svc:15012"])
        );
        shunt_accepts(&json!(["shunt", "agent", "--xds-address", "x:15012"]));

        // The init container's capture flags, as istio-init's, in a dry run.
        let args: Vec<&str> = patch["initContainers"][0]["args"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a.as_str().unwrap())
            .collect();
        let out = Command::new(shunt_bin())
            .args(&args)
            .args(["--backend", "iptables", "--dry-run"])
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            stdout.contains("-A ISTIO_REDIRECT -p tcp -j REDIRECT --to-ports 15001"),
            "{stdout}"
        );
    }
}
