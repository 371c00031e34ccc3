//! Running processes inside a pod.
//!
//! A child joins its pod in `pre_exec` (after fork, before exec): it writes its pid to
//! the pod cgroup's `cgroup.procs`, `setns`es into the pod netns (both fds opened by
//! the parent), drops supplementary groups and sets gid and uid. It also asks for
//! SIGKILL when its parent dies; all forks happen on one long-lived "spawner" thread,
//! so that fires when the test process exits (even if it is SIGKILLed), not when the
//! thread that asked for the spawn ends.

use crate::pod::Pod;
use anyhow::{Context, Result, bail, ensure};
use std::{
    ffi::{OsStr, OsString},
    fs::{File, OpenOptions},
    io::{self, Read, Write},
    os::{fd::AsRawFd, unix::process::CommandExt},
    path::PathBuf,
    process::{Child, Command, ExitStatus, Output, Stdio},
    sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, mpsc},
    thread,
    time::{Duration, Instant},
};

const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);

/// Builder for a process inside a pod; see [`Pod::command`]. Runs as root (uid 0,
/// gid 0) unless [`PodCommand::uid`]/[`PodCommand::gid`] say otherwise; supplementary
/// groups are always cleared. stdin is empty unless [`PodCommand::stdin_bytes`] is
/// used; stdout and stderr are captured.
pub struct PodCommand {
    pod: Pod,
    program: OsString,
    args: Vec<OsString>,
    envs: Vec<(OsString, OsString)>,
    uid: u32,
    gid: u32,
    timeout: Duration,
    stdin: Option<Vec<u8>>,
    current_dir: Option<PathBuf>,
    resolv_conf: Option<PathBuf>,
}

impl PodCommand {
    pub(crate) fn new(pod: Pod, program: &OsStr) -> PodCommand {
        PodCommand {
            pod,
            program: program.to_owned(),
            args: Vec::new(),
            envs: Vec::new(),
            uid: 0,
            gid: 0,
            timeout: DEFAULT_TIMEOUT,
            stdin: None,
            current_dir: None,
            resolv_conf: None,
        }
    }

    pub fn arg(mut self, arg: impl AsRef<OsStr>) -> Self {
        self.args.push(arg.as_ref().to_owned());
        self
    }

    pub fn args<I, S>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        self.args
            .extend(args.into_iter().map(|a| a.as_ref().to_owned()));
        self
    }

    /// Add an environment variable (the rest of the environment is inherited).
    pub fn env(mut self, key: impl AsRef<OsStr>, value: impl AsRef<OsStr>) -> Self {
        self.envs
            .push((key.as_ref().to_owned(), value.as_ref().to_owned()));
        self
    }

    /// Run with this uid (default 0).
    pub fn uid(mut self, uid: u32) -> Self {
        self.uid = uid;
        self
    }

    /// Run with this gid (default 0).
    pub fn gid(mut self, gid: u32) -> Self {
        self.gid = gid;
        self
    }

    /// Limit for [`PodCommand::output`] (default 30 s). Not used by `spawn`.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Feed these bytes on stdin, then close it.
    pub fn stdin_bytes(mut self, data: impl Into<Vec<u8>>) -> Self {
        self.stdin = Some(data.into());
        self
    }

    pub fn current_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.current_dir = Some(dir.into());
        self
    }

    /// Give the process (and its children) this file as `/etc/resolv.conf`: it runs in
    /// a mount namespace of its own where the file is bind-mounted there, as a pod's
    /// containers get their own resolv.conf. The host's file is never touched.
    pub fn resolv_conf(mut self, path: impl Into<PathBuf>) -> Self {
        self.resolv_conf = Some(path.into());
        self
    }

    /// `program args... (pod P, uid U)`, as used in error messages.
    pub fn description(&self) -> String {
        let mut s = self.program.to_string_lossy().into_owned();
        for a in &self.args {
            s.push(' ');
            s.push_str(&a.to_string_lossy());
        }
        format!(
            "`{s}` (pod {}, uid {}, gid {})",
            self.pod.name(),
            self.uid,
            self.gid
        )
    }

    /// Run to completion (exit, and EOF on stdout and stderr) and collect the output.
    /// A non-zero exit is not an error; exceeding the timeout is (the process is
    /// killed, and the error names the command and shows its output so far).
    pub fn output(self) -> Result<Output> {
        let timeout = self.timeout;
        let mut proc = self.spawn()?;
        let deadline = Instant::now() + timeout;
        let mut nap = Duration::from_millis(1);
        loop {
            if let Some(status) = proc.try_wait()
                && proc.stdout.is_eof()
                && proc.stderr.is_eof()
            {
                return Ok(Output {
                    status,
                    stdout: proc.stdout.bytes(),
                    stderr: proc.stderr.bytes(),
                });
            }
            if Instant::now() >= deadline {
                proc.kill();
                bail!(
                    "{} timed out after {timeout:?} and was killed\n{}",
                    proc.desc,
                    proc.output_so_far()
                );
            }
            thread::sleep(nap);
            nap = (nap * 2).min(Duration::from_millis(20));
        }
    }

    /// [`PodCommand::output`], but a non-zero exit is an error too (with the output in
    /// the message). Returns stdout as text.
    pub fn output_ok(self) -> Result<String> {
        let desc = self.description();
        let out = self.output()?;
        if !out.status.success() {
            bail!(
                "{desc} failed ({})\nstdout:\n{}\nstderr:\n{}",
                out.status,
                String::from_utf8_lossy(&out.stdout).trim_end(),
                String::from_utf8_lossy(&out.stderr).trim_end()
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Start in the background. The node tracks the process: dropping either the
    /// returned [`PodProcess`] or the [`crate::Node`] kills and reaps it.
    pub fn spawn(self) -> Result<PodProcess> {
        let desc = self.description();
        let node = self.pod.node().clone();
        if node.is_closed() {
            bail!("cannot run {desc}: node {} has been dropped", node.name);
        }
        let netns = File::open(self.pod.netns_path())
            .with_context(|| format!("opening {}", self.pod.netns_path().display()))?;
        let procs_path = self.pod.cgroup_path().join("cgroup.procs");
        let cgroup_procs = OpenOptions::new()
            .write(true)
            .open(&procs_path)
            .with_context(|| format!("opening {}", procs_path.display()))?;

        let mut cmd = Command::new(&self.program);
        cmd.args(&self.args)
            .envs(self.envs.iter().map(|(k, v)| (k, v)))
            .stdin(if self.stdin.is_some() {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if let Some(dir) = &self.current_dir {
            cmd.current_dir(dir);
        }
        let (uid, gid) = (self.uid, self.gid);
        let resolv_conf = match &self.resolv_conf {
            Some(path) => {
                ensure!(
                    path.is_file(),
                    "{desc}: resolv.conf {} is not a file",
                    path.display()
                );
                Some(std::ffi::CString::new(path.as_os_str().as_encoded_bytes())?)
            }
            None => None,
        };
        // SAFETY: getpid is always safe.
        let parent = unsafe { libc::getpid() };
        // SAFETY: the closure only makes async-signal-safe syscalls and allocates
        // nothing (io::Error::last_os_error does not allocate; the path was made above).
        unsafe {
            cmd.pre_exec(move || {
                if let Some(path) = &resolv_conf {
                    own_resolv_conf(path)?;
                }
                enter_pod(&cgroup_procs, &netns, uid, gid, parent)
            });
        }
        let mut child = spawn_on_spawner_thread(cmd).with_context(|| format!("starting {desc}"))?;

        let stdout = Stream::drain(child.stdout.take().expect("stdout is piped"));
        let stderr = Stream::drain(child.stderr.take().expect("stderr is piped"));
        if let (Some(data), Some(mut stdin)) = (self.stdin, child.stdin.take()) {
            thread::spawn(move || {
                let _ = stdin.write_all(&data);
            });
        }
        let inner = Arc::new(ProcInner {
            pid: child.id(),
            state: Mutex::new(ChildState {
                child,
                status: None,
            }),
        });
        node.register(&inner)
            .with_context(|| format!("starting {desc}"))?;
        Ok(PodProcess {
            inner,
            stdout,
            stderr,
            desc,
        })
    }
}

/// Runs in the forked child, before it gives up root: a private mount namespace with
/// `path` bind-mounted over `/etc/resolv.conf`.
fn own_resolv_conf(path: &std::ffi::CStr) -> io::Result<()> {
    let check = |rc: libc::c_int| {
        if rc == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    };
    // SAFETY: async-signal-safe syscalls; every string is NUL-terminated and outlives them.
    unsafe {
        check(libc::unshare(libc::CLONE_NEWNS))?;
        // Private first, so the bind mount does not propagate back to the host.
        check(libc::mount(
            std::ptr::null(),
            c"/".as_ptr(),
            std::ptr::null(),
            libc::MS_REC | libc::MS_PRIVATE,
            std::ptr::null(),
        ))?;
        check(libc::mount(
            path.as_ptr(),
            c"/etc/resolv.conf".as_ptr(),
            std::ptr::null(),
            libc::MS_BIND,
            std::ptr::null(),
        ))
    }
}

/// Runs in the forked child. Order matters: cgroup and netns need privileges that
/// setuid gives up; setuid clears the parent-death signal, so that comes last.
fn enter_pod(
    cgroup_procs: &File,
    netns: &File,
    uid: u32,
    gid: u32,
    parent: libc::pid_t,
) -> io::Result<()> {
    let check = |rc: libc::c_int| {
        if rc == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    };
    // SAFETY: async-signal-safe syscalls on fds we own; the buffer is on the stack.
    unsafe {
        let mut buf = [0u8; 12];
        let digits = format_decimal(libc::getpid() as u32, &mut buf);
        if libc::write(
            cgroup_procs.as_raw_fd(),
            digits.as_ptr().cast(),
            digits.len(),
        ) < 0
        {
            return Err(io::Error::last_os_error());
        }
        check(libc::setns(netns.as_raw_fd(), libc::CLONE_NEWNET))?;
        check(libc::setgroups(0, std::ptr::null()))?;
        check(libc::setgid(gid))?;
        check(libc::setuid(uid))?;
        check(libc::prctl(
            libc::PR_SET_PDEATHSIG,
            libc::SIGKILL as libc::c_ulong,
        ))?;
        if libc::getppid() != parent {
            // The parent died before prctl took effect.
            libc::_exit(1);
        }
    }
    Ok(())
}

fn format_decimal(mut n: u32, buf: &mut [u8; 12]) -> &[u8] {
    let mut i = buf.len();
    loop {
        i -= 1;
        buf[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            return &buf[i..];
        }
    }
}

type SpawnJob = (Command, mpsc::Sender<io::Result<Child>>);

/// Fork on one thread that lives as long as the process, so PR_SET_PDEATHSIG (which is
/// tied to the forking *thread*) only fires when the test process goes away.
fn spawn_on_spawner_thread(cmd: Command) -> io::Result<Child> {
    static SPAWNER: OnceLock<mpsc::Sender<SpawnJob>> = OnceLock::new();
    let jobs = SPAWNER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<SpawnJob>();
        thread::Builder::new()
            .name("pod-spawner".into())
            .spawn(move || {
                for (mut cmd, reply) in rx {
                    let _ = reply.send(cmd.spawn());
                }
            })
            .expect("starting the pod-spawner thread");
        tx
    });
    let gone = || io::Error::other("the pod-spawner thread is gone");
    let (reply_tx, reply_rx) = mpsc::channel();
    jobs.send((cmd, reply_tx)).map_err(|_| gone())?;
    reply_rx.recv().map_err(|_| gone())?
}

pub(crate) struct ProcInner {
    pid: u32,
    state: Mutex<ChildState>,
}

struct ChildState {
    child: Child,
    status: Option<ExitStatus>,
}

impl ProcInner {
    fn lock(&self) -> MutexGuard<'_, ChildState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// SIGKILL (unless already reaped) and reap. Idempotent.
    pub(crate) fn kill_and_reap(&self) {
        let mut st = self.lock();
        if st.status.is_none() {
            let _ = st.child.kill();
            if let Ok(status) = st.child.wait() {
                st.status = Some(status);
            }
        }
    }

    fn try_wait(&self) -> Option<ExitStatus> {
        let mut st = self.lock();
        if st.status.is_none() {
            st.status = st.child.try_wait().ok().flatten();
        }
        st.status
    }
}

/// A background process in a pod. Dropping it kills and reaps it (so does dropping
/// the node). stdout and stderr are drained continuously into buffers.
pub struct PodProcess {
    inner: Arc<ProcInner>,
    stdout: Arc<Stream>,
    stderr: Arc<Stream>,
    desc: String,
}

impl PodProcess {
    pub fn pid(&self) -> u32 {
        self.inner.pid
    }

    /// The command line and pod, for messages.
    pub fn description(&self) -> &str {
        &self.desc
    }

    /// Everything printed on stdout so far (lossy UTF-8).
    pub fn stdout_text(&self) -> String {
        self.stdout.text()
    }

    /// Everything printed on stderr so far (lossy UTF-8).
    pub fn stderr_text(&self) -> String {
        self.stderr.text()
    }

    /// The first complete stdout line (counting from the start of the output, without
    /// its newline) for which `pred` is true. Fails after `timeout`, or as soon as
    /// stdout is closed without such a line; the error shows the output.
    pub fn wait_for_stdout(
        &self,
        pred: impl Fn(&str) -> bool,
        timeout: Duration,
    ) -> Result<String> {
        self.wait_for_line(&self.stdout, "stdout", pred, timeout)
    }

    /// [`PodProcess::wait_for_stdout`] for stderr.
    pub fn wait_for_stderr(
        &self,
        pred: impl Fn(&str) -> bool,
        timeout: Duration,
    ) -> Result<String> {
        self.wait_for_line(&self.stderr, "stderr", pred, timeout)
    }

    fn wait_for_line(
        &self,
        stream: &Stream,
        which: &str,
        pred: impl Fn(&str) -> bool,
        timeout: Duration,
    ) -> Result<String> {
        let deadline = Instant::now() + timeout;
        let mut st = stream.lock();
        loop {
            let text = String::from_utf8_lossy(&st.data);
            let complete = if st.eof {
                &text[..]
            } else {
                text.rfind('\n').map_or("", |end| &text[..end])
            };
            if let Some(line) = complete.lines().find(|l| pred(l)) {
                return Ok(line.to_owned());
            }
            if st.eof {
                drop(st);
                let status = self
                    .try_wait()
                    .map_or("still running".to_owned(), |s| s.to_string());
                bail!(
                    "{} closed {which} ({status}) without printing the awaited line\n{}",
                    self.desc,
                    self.output_so_far()
                );
            }
            let now = Instant::now();
            if now >= deadline {
                drop(st);
                bail!(
                    "{} printed no awaited {which} line within {timeout:?}\n{}",
                    self.desc,
                    self.output_so_far()
                );
            }
            st = stream
                .cv
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Exit status, if it has exited (reaps it).
    pub fn try_wait(&self) -> Option<ExitStatus> {
        self.inner.try_wait()
    }

    /// Wait up to `timeout` for the process to exit by itself.
    pub fn wait_timeout(&mut self, timeout: Duration) -> Result<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.try_wait() {
                return Ok(status);
            }
            if Instant::now() >= deadline {
                bail!(
                    "{} still running after {timeout:?}\n{}",
                    self.desc,
                    self.output_so_far()
                );
            }
            thread::sleep(Duration::from_millis(5));
        }
    }

    /// Send a signal (e.g. `libc::SIGTERM`) unless the process was already reaped.
    pub fn signal(&self, signal: libc::c_int) -> Result<()> {
        let st = self.inner.lock();
        if st.status.is_some() {
            bail!("{} has already exited", self.desc);
        }
        // SAFETY: plain syscall; the pid is still ours (not reaped, lock held).
        if unsafe { libc::kill(self.inner.pid as libc::pid_t, signal) } != 0 {
            return Err(io::Error::last_os_error())
                .with_context(|| format!("signalling {}", self.desc));
        }
        Ok(())
    }

    /// SIGKILL and reap. Idempotent.
    pub fn kill(&mut self) {
        self.inner.kill_and_reap();
    }

    fn output_so_far(&self) -> String {
        format!(
            "--- stdout ---\n{}\n--- stderr ---\n{}",
            tail(&self.stdout_text()),
            tail(&self.stderr_text())
        )
    }
}

impl Drop for PodProcess {
    fn drop(&mut self) {
        self.inner.kill_and_reap();
    }
}

impl std::fmt::Debug for PodProcess {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PodProcess")
            .field("pid", &self.inner.pid)
            .field("command", &self.desc)
            .finish()
    }
}

fn tail(text: &str) -> &str {
    const MAX: usize = 4000;
    let text = text.trim_end();
    if text.len() <= MAX {
        return text;
    }
    let mut start = text.len() - MAX;
    while !text.is_char_boundary(start) {
        start += 1;
    }
    &text[start..]
}

/// A pipe drained by a thread into a growing buffer.
struct Stream {
    state: Mutex<StreamState>,
    cv: Condvar,
}

struct StreamState {
    data: Vec<u8>,
    eof: bool,
}

impl Stream {
    fn drain(mut pipe: impl Read + Send + 'static) -> Arc<Stream> {
        let stream = Arc::new(Stream {
            state: Mutex::new(StreamState {
                data: Vec::new(),
                eof: false,
            }),
            cv: Condvar::new(),
        });
        let s = stream.clone();
        thread::spawn(move || {
            let mut buf = [0u8; 16 * 1024];
            loop {
                let n = match pipe.read(&mut buf) {
                    Ok(n) => n,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(_) => 0,
                };
                let mut st = s.lock();
                if n == 0 {
                    st.eof = true;
                } else {
                    st.data.extend_from_slice(&buf[..n]);
                }
                s.cv.notify_all();
                if st.eof {
                    return;
                }
            }
        });
        stream
    }

    fn lock(&self) -> MutexGuard<'_, StreamState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.lock().data).into_owned()
    }

    fn bytes(&self) -> Vec<u8> {
        self.lock().data.clone()
    }

    fn is_eof(&self) -> bool {
        self.lock().eof
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn formats_decimal() {
        let mut buf = [0u8; 12];
        assert_eq!(super::format_decimal(0, &mut buf), b"0");
        assert_eq!(super::format_decimal(4194304, &mut buf), b"4194304");
        assert_eq!(super::format_decimal(u32::MAX, &mut buf), b"4294967295");
    }
}
