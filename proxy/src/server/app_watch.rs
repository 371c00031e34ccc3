//! `--exit-when-app-exits`: how the classic sidecar shape learns that the app is gone,
//! so a Job's pod completes and a terminating pod's outbound is served exactly as long
//! as the app needs it.
//!
//! With the pod's process namespace shared (`shareProcessNamespace: true`) every
//! container's processes are in the agent's `/proc`. A process belongs to another
//! container when its cgroup (`/proc/PID/cgroup`, as this process reads it) differs
//! from the agent's own: the runtime gives each container a cgroup of its own, and the
//! agent's hooks (`shunt agent wait` as postStart) run in the agent's. PID 1 is the
//! pod's sandbox (pause), which lives as long as the pod. So the app is every other
//! process, and it has exited once it has been seen and none of it is left (zombies
//! count as gone: their parent has yet to reap them, nothing runs).
//!
//! Other long-running containers count as the app too: the agent stays while any of
//! them runs. A watch in a process namespace of its own (the agent is PID 1) could
//! never see the app, so it is refused at start. The app must live at least one look
//! ([`PERIOD`]) to be seen; and a pod whose app container is restarted
//! (`restartPolicy: OnFailure`) must not use it, as the agent would leave between two
//! runs of the app.

use std::path::{Path, PathBuf};
use std::time::Duration;

/// How often `/proc` is read: a pod has a handful of processes, so this costs nothing
/// (tens of microseconds a look), and a Job's pod completes within this of its app.
/// It is also how long the app must run to be seen at all: a look finds only the
/// processes alive at that moment, and nothing in `/proc` tells of one that came and
/// went in between. A Job that may end sooner ends with `POST /quitquitquit`.
pub const PERIOD: Duration = Duration::from_millis(100);

/// Why the app cannot be watched.
#[derive(Debug, thiserror::Error)]
pub enum WatchError {
    #[error(
        "--exit-when-app-exits: this process is PID 1 of its own process namespace, so the \
         app's processes are not visible; set `shareProcessNamespace: true` on the pod"
    )]
    NotShared,
    #[error("--exit-when-app-exits: reading {path}: {source}")]
    Proc {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// The app's processes, seen through a shared process namespace.
#[derive(Debug)]
pub struct AppWatch {
    proc: PathBuf,
    /// This container's cgroup, as `/proc/self/cgroup` says it.
    own: String,
    /// The app's processes have been seen at least once.
    seen: bool,
}

impl AppWatch {
    /// Watches from `/proc`, refusing a process namespace of its own.
    pub fn start() -> Result<AppWatch, WatchError> {
        if std::process::id() == 1 {
            return Err(WatchError::NotShared);
        }
        AppWatch::at(Path::new("/proc"), std::process::id())
    }

    /// Watches the processes of the procfs at `proc`, as process `me` sees them.
    fn at(proc: &Path, me: u32) -> Result<AppWatch, WatchError> {
        let path = proc.join(me.to_string()).join("cgroup");
        let own = std::fs::read_to_string(&path).map_err(|source| WatchError::Proc {
            path: path.clone(),
            source,
        })?;
        Ok(AppWatch {
            proc: proc.to_owned(),
            own,
            seen: false,
        })
    }

    /// The app's live processes now.
    pub fn app_processes(&self) -> Result<Vec<u32>, WatchError> {
        let entries = std::fs::read_dir(&self.proc).map_err(|source| WatchError::Proc {
            path: self.proc.clone(),
            source,
        })?;
        let mut app = Vec::new();
        for entry in entries.flatten() {
            let Some(pid) = entry
                .file_name()
                .to_str()
                .and_then(|n| n.parse::<u32>().ok())
            else {
                continue;
            };
            // Gone between the listing and the reads: not the app any more.
            if pid != 1 && self.is_app(&entry.path()).unwrap_or(false) {
                app.push(pid);
            }
        }
        app.sort_unstable();
        Ok(app)
    }

    /// A live process of another container.
    fn is_app(&self, dir: &Path) -> std::io::Result<bool> {
        let cgroup = std::fs::read_to_string(dir.join("cgroup"))?;
        if cgroup == self.own {
            return Ok(false);
        }
        let stat = std::fs::read_to_string(dir.join("stat"))?;
        // "PID (comm) STATE ...": comm may hold anything, so read after the last ')'.
        let state = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next());
        Ok(!matches!(state, Some("Z" | "X" | "x")))
    }

    /// Whether the app has come and gone, updating what has been seen.
    pub fn check(&mut self) -> Result<Gone, WatchError> {
        let app = self.app_processes()?;
        if !app.is_empty() {
            if !self.seen {
                tracing::info!(processes = ?app, "the app's processes are running");
            }
            self.seen = true;
            return Ok(Gone::No);
        }
        Ok(if self.seen {
            Gone::Yes
        } else {
            Gone::NotSeenYet
        })
    }

    /// Resolves once the app has been seen and none of its processes is left; a
    /// `/proc` that cannot be read ends the watch (logged), as the app cannot be seen.
    pub async fn exited(&mut self) {
        let mut tick = tokio::time::interval(PERIOD);
        loop {
            tick.tick().await;
            match self.check() {
                Ok(Gone::Yes) => return,
                Ok(_) => {}
                Err(err) => {
                    tracing::error!("{err}: no longer watching the app");
                    std::future::pending::<()>().await;
                }
            }
        }
    }

    /// Looks at `/proc` now and says whether the app has been seen (it may have
    /// exited since). SIGTERM asks this, as: the periodic look may be up to [`PERIOD`] old.
    pub fn seen_now(&self) -> bool {
        match self.app_processes() {
            Ok(app) => self.seen || !app.is_empty(),
            Err(err) => {
                tracing::warn!("{err}");
                self.seen
            }
        }
    }
}

/// What a look at `/proc` says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gone {
    /// Not started yet (the classic shape holds it until the proxy is ready).
    NotSeenYet,
    No,
    Yes,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake procfs: pid -> (cgroup, state).
    fn procfs(dir: &Path, processes: &[(u32, &str, char)]) {
        let _ = std::fs::remove_dir_all(dir);
        for (pid, cgroup, state) in processes {
            let p = dir.join(pid.to_string());
            std::fs::create_dir_all(&p).unwrap();
            std::fs::write(p.join("cgroup"), format!("0::{cgroup}\n")).unwrap();
            std::fs::write(p.join("stat"), format!("{pid} (a (b) c) {state} 1 1")).unwrap();
        }
    }

    #[test]
    fn the_app_is_every_other_containers_live_process_but_the_sandbox() {
        let dir = std::env::temp_dir().join(format!("shunt-app-watch-{}", std::process::id()));
        let agent = "/";
        let app = "/../app";
        procfs(
            &dir,
            &[(1, "/../pause", 'S'), (7, agent, 'S'), (9, agent, 'S')],
        );
        let mut watch = AppWatch::at(&dir, 7).unwrap();
        assert_eq!(
            watch.check().unwrap(),
            Gone::NotSeenYet,
            "pause and the agent only"
        );

        procfs(
            &dir,
            &[
                (1, "/../pause", 'S'),
                (7, agent, 'S'),
                (12, app, 'R'),
                (13, app, 'S'),
            ],
        );
        assert_eq!(watch.app_processes().unwrap(), vec![12, 13]);
        assert_eq!(watch.check().unwrap(), Gone::No);

        // A zombie left for its parent to reap is not the app running.
        procfs(
            &dir,
            &[(1, "/../pause", 'S'), (7, agent, 'S'), (12, app, 'Z')],
        );
        assert_eq!(watch.check().unwrap(), Gone::Yes);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
