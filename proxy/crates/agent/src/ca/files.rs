//! Istio's file-mounted certificates: `cert-chain.pem`, `key.pem` and `root-cert.pem`
//! in one folder (`/etc/certs` by default), put there by something else (a Secret
//! volume, cert-manager). The folder is polled: a change of any file's modification time,
//! size or inode reloads all three, and the set is published only if it checks out, so a
//! half-written replacement is not served (the old bundle stays until a later change
//! makes the set whole).

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
    // The files as last loaded, and as last tried: a bad set is reported once, and
    // tried again when any file changes.
    let mut tried = stamp(&options.dir);
    publisher.publish(load(&options.dir).map_err(anyhow::Error::msg)?);
    Ok(tokio::spawn(async move {
        let mut tick = tokio::time::interval(options.poll);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        while !publisher.bundle.is_closed() {
            tick.tick().await;
            let now = stamp(&options.dir);
            if now == tried {
                continue;
            }
            tried = now;
            match load(&options.dir) {
                Ok(bundle) => {
                    tracing::info!(serial = %bundle.serial, dir = %options.dir.display(), "mounted certificates reloaded");
                    publisher.publish(bundle);
                }
                Err(error) => {
                    tracing::warn!("mounted certificates not reloaded, the old ones stay: {error}");
                    publisher.failed(error);
                }
            }
        }
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ca::CertificateProvider;
    use crate::ca::bundle::tests::root;

    #[tokio::test]
    async fn a_half_written_replacement_is_not_served_and_the_whole_set_is() {
        let dir = std::env::temp_dir().join(format!("shunt-files-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (root_pem, issue) = root();
        let (chain1, key1) = issue("spiffe://td/ns/a/sa/one");
        for (name, text) in [(ROOT_CERT, &root_pem), (KEY, &key1), (CERT_CHAIN, &chain1)] {
            std::fs::write(dir.join(name), text).unwrap();
        }
        let options = FileOptions {
            dir: dir.clone(),
            poll: Duration::from_millis(20),
        };
        let (provider, _task) = CertificateProvider::start_files(options).unwrap();
        let first = provider.current().unwrap();
        assert_eq!(first.uris, ["spiffe://td/ns/a/sa/one"]);

        // The new chain lands before its key: the pair does not match, the old stays.
        let (chain2, key2) = issue("spiffe://td/ns/a/sa/two");
        std::fs::write(dir.join(CERT_CHAIN), &chain2).unwrap();
        let mut rx = provider.subscribe();
        while provider.status().failures == 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(provider.current().unwrap().serial, first.serial);
        let error = provider.status().last_error.unwrap();
        assert!(
            error.contains(&dir.display().to_string()) && error.contains("private key"),
            "{error}"
        );

        std::fs::write(dir.join(KEY), &key2).unwrap();
        rx.changed().await.unwrap();
        assert_eq!(
            provider.current().unwrap().uris,
            ["spiffe://td/ns/a/sa/two"]
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn missing_files_are_an_error_at_start() {
        let options = FileOptions {
            dir: "/nonexistent/certs".into(),
            poll: Duration::from_secs(1),
        };
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let _guard = runtime.enter();
        let err = CertificateProvider::start_files(options)
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("/nonexistent/certs/cert-chain.pem"), "{err}");
    }
}
