//! Installing `shunt-cni` on a node: the binary into the CNI bin directory, and an entry
//! chained at the end of the cluster's network configuration (the first file of the
//! configuration directory, as the kubelet's runtime picks it). Other plugins and keys
//! are kept; installing twice leaves one entry; uninstalling removes only ours.

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use serde_json::{Value, json};

/// The plugin's `type` (and file name in the bin directory).
pub const PLUGIN_TYPE: &str = "shunt-cni";

/// What `install` writes into the conflist besides `type`.
#[derive(Debug, Clone)]
pub struct PluginSettings {
    pub agent_socket: PathBuf,
    pub agent_unavailable: String,
    pub exclude_namespaces: Vec<String>,
}

/// The network configuration file the runtime uses: the first `.conflist`, `.conf` or
/// `.json` file in `conf_dir` by name.
pub fn primary_config(conf_dir: &Path) -> anyhow::Result<Option<PathBuf>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(conf_dir)
        .with_context(|| format!("reading {}", conf_dir.display()))?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| {
            p.is_file()
                && p.extension()
                    .is_some_and(|x| x == "conflist" || x == "conf" || x == "json")
        })
        .collect();
    files.sort();
    Ok(files.into_iter().next())
}

/// Copies `plugin` to `bin_dir/shunt-cni` (by a temporary name and a rename, so a
/// runtime never executes half a file) and chains the plugin into the primary conflist.
/// Returns the conflist written.
pub fn install(
    plugin: &Path,
    bin_dir: &Path,
    conf_dir: &Path,
    settings: &PluginSettings,
) -> anyhow::Result<PathBuf> {
    std::fs::create_dir_all(bin_dir).with_context(|| format!("creating {}", bin_dir.display()))?;
    let target = bin_dir.join(PLUGIN_TYPE);
    let tmp = bin_dir.join(format!(".{PLUGIN_TYPE}.tmp"));
    std::fs::copy(plugin, &tmp)
        .with_context(|| format!("copying {} to {}", plugin.display(), tmp.display()))?;
    std::fs::rename(&tmp, &target).with_context(|| format!("installing {}", target.display()))?;

    let Some(conf) = primary_config(conf_dir)? else {
        bail!(
            "no CNI network configuration in {}: install shunt-cni after the primary plugin wrote its own",
            conf_dir.display()
        );
    };
    let mut list = read_as_list(&conf)?;
    let plugins = plugins_mut(&mut list, &conf)?;
    plugins.retain(|p| !is_ours(p));
    plugins.push(json!({
        "type": PLUGIN_TYPE,
        "agent_socket": settings.agent_socket,
        "agent_unavailable": settings.agent_unavailable,
        "exclude_namespaces": settings.exclude_namespaces,
        // The runtime then passes the pod's resolv.conf (`runtimeConfig.dns`): the
        // resolvers its DNS proxy forwards to.
        "capabilities": {"dns": true},
    }));
    // A single-plugin `.conf` becomes a `.conflist` (the runtime reads a `.conf` as one
    // plugin); the `.conf` is removed after the list is in place.
    let out = if conf.extension().is_some_and(|x| x == "conf") {
        conf.with_extension("conflist")
    } else {
        conf.clone()
    };
    write_json(&out, &list)?;
    if out != conf {
        std::fs::remove_file(&conf).with_context(|| format!("removing {}", conf.display()))?;
    }
    Ok(out)
}

/// Removes our entry from every conflist in `conf_dir` and the binary from `bin_dir`.
/// Returns the files changed.
pub fn uninstall(bin_dir: &Path, conf_dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let mut changed = Vec::new();
    for entry in
        std::fs::read_dir(conf_dir).with_context(|| format!("reading {}", conf_dir.display()))?
    {
        let path = entry?.path();
        if path.extension().is_none_or(|x| x != "conflist") {
            continue;
        }
        let mut list = read_as_list(&path)?;
        let plugins = plugins_mut(&mut list, &path)?;
        let before = plugins.len();
        plugins.retain(|p| !is_ours(p));
        if plugins.len() != before {
            write_json(&path, &list)?;
            changed.push(path);
        }
    }
    match std::fs::remove_file(bin_dir.join(PLUGIN_TYPE)) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            return Err(e).context(format!("removing {PLUGIN_TYPE} from {}", bin_dir.display()));
        }
        _ => {}
    }
    Ok(changed)
}

fn is_ours(plugin: &Value) -> bool {
    plugin.get("type").and_then(Value::as_str) == Some(PLUGIN_TYPE)
}

/// A conflist as is; a single-plugin `.conf` wrapped into one.
fn read_as_list(path: &Path) -> anyhow::Result<Value> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut value: Value =
        serde_json::from_str(&text).with_context(|| format!("{}: not JSON", path.display()))?;
    if value.get("plugins").is_none() {
        let obj = value
            .as_object_mut()
            .with_context(|| format!("{}: not a JSON object", path.display()))?;
        let version = obj.get("cniVersion").cloned().unwrap_or(json!("1.0.0"));
        let name = obj.get("name").cloned().unwrap_or(json!("k8s-pod-network"));
        obj.remove("name");
        value = json!({"cniVersion": version, "name": name, "plugins": [value]});
    }
    Ok(value)
}

fn plugins_mut<'a>(list: &'a mut Value, path: &Path) -> anyhow::Result<&'a mut Vec<Value>> {
    list.get_mut("plugins")
        .and_then(Value::as_array_mut)
        .with_context(|| format!("{}: .plugins is not a list", path.display()))
}

fn write_json(path: &Path, value: &Value) -> anyhow::Result<()> {
    let tmp = path.with_extension("shunt-tmp");
    let mut text = serde_json::to_string_pretty(value)?;
    text.push('\n');
    std::fs::write(&tmp, text).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings() -> PluginSettings {
        PluginSettings {
            agent_socket: "/var/run/shunt/cni.sock".into(),
            agent_unavailable: "fail".into(),
            exclude_namespaces: vec!["kube-system".into()],
        }
    }

    fn scratch(name: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("shunt-cni-install-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("net.d")).unwrap();
        std::fs::create_dir_all(dir.join("bin")).unwrap();
        dir
    }

    #[test]
    fn install_chains_once_keeps_other_plugins_and_uninstall_restores() {
        let dir = scratch("chain");
        let conf = dir.join("net.d/10-bridge.conflist");
        let original = json!({"cniVersion": "1.0.0", "name": "k8s", "plugins": [
            {"type": "bridge", "bridge": "cni0", "ipam": {"type": "host-local"}},
            {"type": "portmap", "capabilities": {"portMappings": true}}]});
        std::fs::write(&conf, original.to_string()).unwrap();
        std::fs::write(dir.join("net.d/99-other.conflist"), "{}").unwrap();
        let plugin = std::env::current_exe().unwrap();
        for _ in 0..2 {
            let out = install(&plugin, &dir.join("bin"), &dir.join("net.d"), &settings()).unwrap();
            assert_eq!(out, conf);
        }
        let list: Value = serde_json::from_str(&std::fs::read_to_string(&conf).unwrap()).unwrap();
        let types: Vec<&str> = list["plugins"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p["type"].as_str().unwrap())
            .collect();
        assert_eq!(types, ["bridge", "portmap", "shunt-cni"]);
        assert_eq!(list["plugins"][2]["agent_unavailable"], "fail");
        assert!(dir.join("bin/shunt-cni").is_file());

        assert_eq!(
            uninstall(&dir.join("bin"), &dir.join("net.d")).unwrap(),
            vec![conf.clone()]
        );
        let back: Value = serde_json::from_str(&std::fs::read_to_string(&conf).unwrap()).unwrap();
        assert_eq!(back, original);
        assert!(!dir.join("bin/shunt-cni").exists());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_single_plugin_conf_becomes_a_conflist() {
        let dir = scratch("conf");
        std::fs::write(
            dir.join("net.d/10-bridge.conf"),
            json!({"cniVersion": "0.4.0", "name": "k8s", "type": "bridge"}).to_string(),
        )
        .unwrap();
        let out = install(
            &std::env::current_exe().unwrap(),
            &dir.join("bin"),
            &dir.join("net.d"),
            &settings(),
        )
        .unwrap();
        assert_eq!(out, dir.join("net.d/10-bridge.conflist"));
        assert!(!dir.join("net.d/10-bridge.conf").exists());
        let list: Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
        assert_eq!(list["name"], "k8s");
        assert_eq!(list["cniVersion"], "0.4.0");
        assert_eq!(list["plugins"][0]["type"], "bridge");
        assert_eq!(list["plugins"][1]["type"], "shunt-cni");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn install_without_a_network_config_says_where_it_looked() {
        let dir = scratch("empty");
        let e = install(
            &std::env::current_exe().unwrap(),
            &dir.join("bin"),
            &dir.join("net.d"),
            &settings(),
        )
        .unwrap_err();
        assert!(e.to_string().contains("net.d"), "{e:#}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
