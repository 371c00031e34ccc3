//! Istio's file-mounted certificates: `cert-chain.pem`, `key.pem` and `root-cert.pem`
//! in one folder (`/etc/certs` by default), put there by something else (a Secret
//! volume, cert-manager). The folder is polled: a change of any file's modification time,
//! size or inode reloads all three, and the set is published only if it checks out, so a
//! half-written replacement is not served (the old bundle stays until the next poll
//! finds the set whole).

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use super::{Bundle, Publisher};

pub const CERT_CHAIN: &str = "cert-chain.pem";
pub const KEY: &str = "key.pem";
pub const ROOT_CERT: &str = "root-cert.pem";

#[derive(Debug, Clone)]
pub struct FileOptions {
    pub dir: PathBuf,
    /// How often the files are looked at.
    pub poll: Duration,
}

impl Default for FileOptions {
    fn default() -> Self {
        FileOptions {
            dir: "/etc/certs".into(),
            poll: Duration::from_secs(5),
        }
    }
}

/// What a poll compares: (modified, length, inode) of each file.
type Stamp = Vec<Option<(SystemTime, u64, u64)>>;

fn stamp(dir: &Path) -> Stamp {
    use std::os::unix::fs::MetadataExt;
    [CERT_CHAIN, KEY, ROOT_CERT]
        .iter()
        .map(|f| {
            let m = std::fs::metadata(dir.join(f)).ok()?;
            Some((m.modified().ok()?, m.len(), m.ino()))
        })
        .collect()
}

/// Reads and checks the three files in `dir`.
pub fn load(dir: &Path) -> Result<Bundle, String> {
    let read = |name: &str| {
        let path = dir.join(name);
        std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))
    };
    Bundle::new(read(CERT_CHAIN)?, read(KEY)?, read(ROOT_CERT)?)
        .map_err(|e| format!("{}: {e}", dir.display()))
}

pub(super) fn start(
    options: FileOptions,
    publisher: Publisher,
) -> anyhow::Result<tokio::task::JoinHandle<()>> {
    let mut seen = stamp(&options.dir);
    publisher.publish(load(&options.dir).map_err(anyhow::Error::msg)?);
    Ok(tokio::spawn(async move {
        let mut tick = tokio::time::interval(options.poll);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        while !publisher.bundle.is_closed() {
            tick.tick().await;
            let now = stamp(&options.dir);
            if now == seen {
                continue;
            }
            match load(&options.dir) {
                Ok(bundle) => {
                    seen = now;
                    tracing::info!(serial = %bundle.serial, dir = %options.dir.display(), "mounted certificates reloaded");
                    publisher.publish(bundle);
                }
                // Keep `seen` as it was: the next poll tries again, whether or not
                // the files change once more.
                Err(error) => {
                    publisher.failed(error.clone());
                    tracing::warn!("mounted certificates not reloaded: {error}");
                }
            }
        }
    }))
}
