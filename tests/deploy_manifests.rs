//! `deploy/`: the manifests validate offline against Kubernetes' OpenAPI schemas
//! (kubernetes-validate from PyPI, strict: unknown fields are errors), the injection
//! template renders into a pod that validates too, and the commands the manifests run
//! are ones the `shunt` binary accepts.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use harness::shunt_bin;
use serde_json::{Value, json};

/// The Kubernetes version the manifests target.
const KUBERNETES: &str = "1.33.0";

fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy")
}

/// Runs kubernetes-validate (installed by `cargo xtask setup`) on `files`:
/// (success, output).
fn validate(files: &[PathBuf]) -> (bool, String) {
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
            KUBERNETES,
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

#[test]
fn the_injection_template_renders_into_a_valid_pod_whose_capture_args_shunt_accepts() {
    let template =
        std::fs::read_to_string(deploy_dir().join("injection/shunt-sidecar.yaml")).unwrap();
    let vars = BTreeMap::from([
        ("SHUNT_IMAGE", "ghcr.io/shunt/shunt:0.1.0"),
        ("DISCOVERY_ADDRESS", "istiod.istio-system.svc:15012"),
        ("CLUSTER_ID", "Kubernetes"),
        ("TRUST_DOMAIN", "cluster.local"),
    ]);
    // Comments name the variables too: render only the YAML.
    let body: String = template
        .lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .map(|l| format!("{l}\n"))
        .collect();
    let rendered = render(&body, &vars).unwrap();
    assert!(
        render(&body, &BTreeMap::new()).is_err(),
        "the template has variables"
    );
    let patch: Value = serde_yaml_ng::from_str(&rendered).unwrap();

    let mut pod = json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "reviews-v1-0", "namespace": "bookinfo", "labels": {"app": "reviews"}},
        "spec": {
            "serviceAccountName": "bookinfo-reviews",
            "containers": [{"name": "reviews", "image": "docker.io/istio/examples-bookinfo-reviews-v1:1.20.1",
                            "ports": [{"containerPort": 9080}]}]
        }
    });
    for list in ["initContainers", "containers", "volumes"] {
        let items = patch[list].as_array().unwrap().clone();
        let target = pod["spec"][list].as_array().cloned().unwrap_or_default();
        pod["spec"][list] = Value::Array(target.into_iter().chain(items).collect());
    }
    let scratch = Scratch::new("inject");
    let file = scratch.0.join("pod.yaml");
    std::fs::write(&file, serde_json::to_string_pretty(&pod).unwrap()).unwrap();
    let (ok, out) = validate(&[file]);
    assert!(ok, "{out}");
    assert_eq!(pod["spec"]["containers"][1]["name"], "istio-proxy");
    assert_eq!(
        pod["spec"]["containers"][1]["args"],
        json!(["agent", "--xds-address", "istiod.istio-system.svc:15012"])
    );

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
