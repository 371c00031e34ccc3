//! Which Kubernetes pod a pod id is (`POD_LABELS`), so decision events and `shunt
//! inspect` can say `default/sleep-7d4b9c` rather than `pod_4026532246`. Node mode
//! writes every pod's label when it enrolls it (its pod records know the names);
//! `shunt capture` writes one when it runs with `POD_NAME` and `POD_NAMESPACE` set
//! (Istio's injected containers carry them). Also how `--pod` finds a pod by name.

use std::{collections::HashMap, path::Path};

use anyhow::{Context, bail};
use aya::maps::{HashMap as BpfHashMap, MapData};
use shunt_common::{PodConfig, events::PodLabel, pins};

use crate::bpffs::Maps;

/// The label `POD_NAMESPACE`/`POD_NAME` give, if both are set.
pub fn from_environment() -> Option<PodLabel> {
    let namespace = std::env::var("POD_NAMESPACE").ok()?;
    let name = std::env::var("POD_NAME").ok()?;
    (!namespace.is_empty() && !name.is_empty()).then(|| PodLabel::new(&namespace, &name))
}

fn labels(root: &Path) -> anyhow::Result<BpfHashMap<MapData, u32, PodLabel>> {
    Maps { root }.hash(pins::POD_LABELS)
}

/// Records `label` for `pod_id`.
pub fn write(root: &Path, pod_id: u32, label: &PodLabel) -> anyhow::Result<()> {
    labels(root)?
        .insert(pod_id, label, 0)
        .with_context(|| format!("POD_LABELS[pod_{pod_id}]"))
}

/// Every labelled pod: id → `namespace/name`.
pub fn all(root: &Path) -> HashMap<u32, String> {
    let Ok(map) = labels(root) else {
        return HashMap::new();
    };
    map.iter()
        .filter_map(Result::ok)
        .map(|(id, l)| (id, format!("{}/{}", l.namespace(), l.name())))
        .collect()
}

/// The pod `--pod` names: `pod_<id>`, its id, `namespace/name`, or a name no other
/// labelled pod has. Only pods with capture installed count.
pub fn resolve(root: &Path, pod: &str) -> anyhow::Result<u32> {
    let enrolled = enrolled(root)?;
    let by_id = pod
        .strip_prefix("pod_")
        .unwrap_or(pod)
        .parse::<u32>()
        .ok()
        .filter(|id| enrolled.contains(id));
    if let Some(id) = by_id {
        return Ok(id);
    }
    let names = all(root);
    let matches: Vec<u32> = names
        .iter()
        .filter(|(id, full)| {
            enrolled.contains(id)
                && (full.as_str() == pod || full.rsplit_once('/').is_some_and(|(_, n)| n == pod))
        })
        .map(|(id, _)| *id)
        .collect();
    match matches.as_slice() {
        [id] => Ok(*id),
        [] => bail!(
            "--pod {pod}: no captured pod has that id or name under {} (`shunt inspect` lists them)",
            root.display()
        ),
        _ => bail!("--pod {pod}: several pods have that name; say namespace/name"),
    }
}

/// The ids of every pod with capture installed (a `POD_CONFIG` entry).
pub fn enrolled(root: &Path) -> anyhow::Result<Vec<u32>> {
    let config: BpfHashMap<MapData, u64, PodConfig> = Maps { root }.hash(pins::POD_CONFIG)?;
    Ok(config
        .iter()
        .filter_map(Result::ok)
        .map(|(_, pc)| pc.pod_id)
        .collect())
}

/// How an event or a line names a pod: `namespace/name` if labelled, else `pod_<id>`;
/// `-` for no pod.
pub fn display(names: &HashMap<u32, String>, pod_id: u32) -> String {
    match (pod_id, names.get(&pod_id)) {
        (0, _) => "-".into(),
        (_, Some(name)) => name.clone(),
        (id, None) => format!("pod_{id}"),
    }
}
