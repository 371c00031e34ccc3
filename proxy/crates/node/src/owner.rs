//! One owner of a node's state at a time. The state directory, the bpffs pins and the
//! CNI socket belong to the process holding an exclusive `flock` on
//! `<state dir>/owner.lock`, taken before anything else is touched. A second process
//! finds it held and either takes the node over from the owner (the upgrade hand-over,
//! [`crate::serve::handover`], which passes this very lock's descriptor along, so the
//! ownership moves without a moment unowned) or leaves, naming the owner.

use std::fs::File;
use std::io::{Read, Seek, Write};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};

use anyhow::Context;
use nix::fcntl::{Flock, FlockArg};

/// The lock file, in the state directory.
pub fn lock_path(state_dir: &Path) -> PathBuf {
    state_dir.join("owner.lock")
}

/// Where the owner offers the node to its successor (the upgrade hand-over).
pub fn handover_path(state_dir: &Path) -> PathBuf {
    state_dir.join("handover.sock")
}

/// The node's state, held.
#[derive(Debug)]
pub struct Owner {
    lock: Flock<File>,
}

/// Someone else holds the node: who it says it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OwnedBy {
    pub lock: PathBuf,
    /// What the owner wrote: `pid <pid> started <unix seconds>`.
    pub owner: String,
}

impl std::fmt::Display for OwnedBy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the node's state is owned by another shunt node ({}; lock {})",
            if self.owner.is_empty() {
                "it has not said who it is"
            } else {
                &self.owner
            },
            self.lock.display()
        )
    }
}

/// What taking the lock found.
pub enum Acquired {
    Owner(Owner),
    Busy(OwnedBy),
}

impl Owner {
    /// Takes the node's lock in `state_dir` (made if missing), without waiting.
    pub fn acquire(state_dir: &Path) -> anyhow::Result<Acquired> {
        std::fs::create_dir_all(state_dir)
            .with_context(|| format!("creating {}", state_dir.display()))?;
        let path = lock_path(state_dir);
        let file = File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .with_context(|| format!("opening {}", path.display()))?;
        match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
            Ok(lock) => {
                let mut owner = Owner { lock };
                owner.say_who()?;
                Ok(Acquired::Owner(owner))
            }
            Err((mut file, nix::errno::Errno::EWOULDBLOCK)) => {
                let mut owner = String::new();
                let _ = file.read_to_string(&mut owner);
                Ok(Acquired::Busy(OwnedBy {
                    lock: path,
                    owner: owner.trim().to_owned(),
                }))
            }
            Err((_, errno)) => Err(std::io::Error::from(errno))
                .with_context(|| format!("locking {}", path.display())),
        }
    }

    /// The lock handed over by the previous owner (its descriptor shares the lock:
    /// the lock is this process's as soon as it arrives).
    pub fn adopt(fd: OwnedFd) -> anyhow::Result<Owner> {
        let file = File::from(fd);
        // Locking the same open file description again only confirms it.
        let lock = Flock::lock(file, FlockArg::LockExclusiveNonblock)
            .map_err(|(_, errno)| std::io::Error::from(errno))
            .context("the handed-over lock is not held")?;
        let mut owner = Owner { lock };
        owner.say_who()?;
        Ok(owner)
    }

    /// The lock's descriptor, to hand to a successor.
    pub fn as_fd(&self) -> BorrowedFd<'_> {
        self.lock.as_fd()
    }

    /// Writes this process's identity into the lock file, for the next one to read.
    fn say_who(&mut self) -> anyhow::Result<()> {
        let since = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let who = format!("pid {} started {since}\n", std::process::id());
        let file: &mut File = &mut self.lock;
        file.set_len(0)?;
        file.rewind()?;
        file.write_all(who.as_bytes())?;
        Ok(())
    }
}
