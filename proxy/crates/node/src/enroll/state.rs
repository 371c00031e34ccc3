//! The state directory: one JSON file per enrolled pod (`pods/<uid>.json`), written
//! whole to a temporary name and renamed, so a crash leaves the old record or the new
//! one, never half of one. After a restart the agent reads it back to rebuild its pods.

use std::io;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::PodInfo;

/// Who enrolled a pod: decides how it is rebuilt after a restart (a CNI pod by its netns
/// path; a ZDS pod when istio-cni sends it again in its snapshot).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Source {
    Cni,
    Zds,
}

/// One pod's record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    pub source: Source,
    pub pod: PodInfo,
}

pub struct StateDir {
    pods: PathBuf,
}

impl StateDir {
    /// Opens (creating) `dir`.
    pub fn open(dir: &Path) -> io::Result<Self> {
        let pods = dir.join("pods");
        std::fs::create_dir_all(&pods)?;
        Ok(Self { pods })
    }

    fn file(&self, uid: &str) -> PathBuf {
        self.pods.join(format!("{uid}.json"))
    }

    pub fn write(&self, record: &Record) -> io::Result<()> {
        let path = self.file(&record.pod.uid);
        let tmp = self.pods.join(format!(".{}.json.tmp", record.pod.uid));
        let json = serde_json::to_vec_pretty(record).map_err(io::Error::other)?;
        std::fs::write(&tmp, json)?;
        std::fs::rename(&tmp, &path)
    }

    pub fn remove(&self, uid: &str) -> io::Result<()> {
        match std::fs::remove_file(self.file(uid)) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        }
    }

    /// Every record, and what could not be read (file and reason): a damaged file is
    /// reported and left for a person to look at, not fatal to the others.
    pub fn read_all(&self) -> io::Result<(Vec<Record>, Vec<String>)> {
        let mut records = Vec::new();
        let mut bad = Vec::new();
        let mut entries: Vec<_> = std::fs::read_dir(&self.pods)?
            .filter_map(Result::ok)
            .map(|e| e.path())
            .filter(|p| {
                p.extension().is_some_and(|x| x == "json")
                    && !p
                        .file_name()
                        .is_some_and(|n| n.to_string_lossy().starts_with('.'))
            })
            .collect();
        entries.sort();
        for path in entries {
            let parsed = std::fs::read(&path)
                .map_err(|e| e.to_string())
                .and_then(|bytes| {
                    serde_json::from_slice::<Record>(&bytes).map_err(|e| e.to_string())
                });
            match parsed {
                Ok(record) if Some(record.pod.uid.as_str()) == stem(&path) => records.push(record),
                Ok(record) => bad.push(format!(
                    "{}: holds pod uid {:?}, not its file name's",
                    path.display(),
                    record.pod.uid
                )),
                Err(e) => bad.push(format!("{}: {e}", path.display())),
            }
        }
        Ok((records, bad))
    }
}

fn stem(path: &Path) -> Option<&str> {
    path.file_stem().and_then(|s| s.to_str())
}

/// A pod uid is a file name here: Kubernetes uids are UUIDs; anything that is not a
/// plain name (a `/`, a leading dot, odd characters) is refused.
pub fn check_uid(uid: &str) -> Result<(), String> {
    if uid.is_empty() {
        return Err("the pod uid is empty".into());
    }
    if uid.len() > 253
        || uid.starts_with('.')
        || !uid
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
    {
        return Err(format!(
            "the pod uid {uid:?} is not a name of letters, digits, '-', '_' and '.'"
        ));
    }
    Ok(())
}
