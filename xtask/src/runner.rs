//! `cargo xtask test`: every test binary runs, each under a time limit, and the run ends
//! with one line that sums them all.
//!
//! `cargo test` stops at the first test binary that fails and waits for ever on one that
//! hangs. Here the test executables are built once (`cargo test --workspace --no-run
//! --message-format=json`) and then run one by one, as cargo would run them (the
//! package's directory as working directory, `CARGO_MANIFEST_DIR`), each in its own
//! process group so that a binary that outlives its time limit is killed with everything
//! it started. Doc tests run as one more step (`cargo test --workspace --doc`).
//!
//! The last line of the output is `N passed, N failed` (`, N ignored` when some were),
//! summed from libtest's `test result:` lines; a binary that crashes or times out adds
//! one failure at least, as does a failed lint. The exit status is non-zero when
//! anything failed.

use std::{
    io::{BufRead, BufReader, Write},
    path::PathBuf,
    process::{Command, Stdio},
    sync::{
        Arc, Mutex,
        atomic::{AtomicI32, Ordering},
        mpsc,
    },
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use serde_json::Value;

/// Options of `cargo xtask test`.
pub struct Options {
    /// Passed to every test binary (a name filter, `--nocapture`, ...).
    pub args: Vec<String>,
    /// How long one test binary may run before its process group is killed.
    pub binary_timeout: Duration,
    /// Skip `cargo xtask lint` (fmt, clippy, layer check).
    pub skip_lint: bool,
    /// How long each fuzz target runs as the last step (0: no fuzz step).
    pub fuzz_seconds: u64,
}

/// libtest's counts, summed over the `test result:` lines of one run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    pub passed: u64,
    pub failed: u64,
    pub ignored: u64,
}

impl Counts {
    fn add(&mut self, other: Counts) {
        self.passed += other.passed;
        self.failed += other.failed;
        self.ignored += other.ignored;
    }
}

/// How one step (a test binary, the doc tests, the lint) ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Ending {
    /// Exit status 0.
    Ok,
    /// Exited non-zero (or was killed by a signal); the status as text.
    Failed(String),
    /// Ran out of time; its process group was killed.
    TimedOut,
    /// Could not be started at all.
    NotStarted(String),
}

/// One row of the summary table.
pub struct Row {
    pub name: String,
    pub ending: Ending,
    /// `None` when no `test result:` line was printed.
    pub counts: Option<Counts>,
    pub duration: Duration,
}

impl Row {
    /// The counts this row adds to the total: libtest's, and one failure more for a
    /// step that failed without saying which test did (a crash, a time-out, a lint).
    pub fn effective(&self) -> Counts {
        let mut c = self.counts.unwrap_or_default();
        if self.ending != Ending::Ok && c.failed == 0 {
            c.failed = 1;
        }
        c
    }

    fn status(&self) -> String {
        match &self.ending {
            Ending::Ok => "ok".into(),
            Ending::Failed(s) if self.counts.is_some_and(|c| c.failed > 0) => {
                format!("FAILED ({s})")
            }
            Ending::Failed(s) if self.counts.is_some() => {
                format!("FAILED ({s}, though no test failed)")
            }
            Ending::Failed(s) => format!("FAILED ({s}, no test result line)"),
            Ending::TimedOut => "TIMED OUT (process group killed)".into(),
            Ending::NotStarted(e) => format!("NOT STARTED ({e})"),
        }
    }
}

/// A test executable cargo built, and where cargo would run it.
#[derive(Debug)]
pub struct TestBinary {
    /// `package/target` (`shunt-tests/xds`, `shunt/shunt` for the unit tests).
    pub name: String,
    pub executable: PathBuf,
    pub manifest_dir: PathBuf,
}

/// `setup` is how `cargo xtask setup` went: a failure is one failed row, and the rest
/// still runs (the tests then say what is missing).
pub fn run(opts: &Options, setup: Result<()>) -> Result<()> {
    let start = Instant::now();
    let mut rows = Vec::new();
    if let Err(e) = setup {
        eprintln!("xtask test: setup: {e:#}");
        rows.push(Row {
            name: "setup".into(),
            ending: Ending::Failed(format!("{e:#}")),
            counts: None,
            duration: Duration::ZERO,
        });
    }

    if !opts.skip_lint {
        let t = Instant::now();
        let failures = crate::lint::run_all();
        rows.push(Row {
            name: "lint (fmt, clippy, layers)".into(),
            ending: if failures.is_empty() {
                Ending::Ok
            } else {
                Ending::Failed(format!("{} failed", failures.join(", ")))
            },
            counts: None,
            duration: t.elapsed(),
        });
    }

    // cargo builds the packages' binaries with their integration tests (the tests
    // start `shunt` and `testapp` inside pods): no separate build, which would resolve
    // features without the dev-dependencies' and compile shunt a second time.
    println!(
        "\n=== build: cargo test --workspace --no-run (every test binary, the eBPF programs, \
         shunt and testapp; 15-25 minutes on a fresh 2-core machine, seconds once built)"
    );
    let built =
        build_test_binaries().and_then(|binaries| crate::pods::Bins::debug().map(|_| binaries));
    match built {
        Err(e) => {
            eprintln!("xtask test: error: {e:#}");
            rows.push(Row {
                name: "build".into(),
                ending: Ending::Failed(format!("{e:#}")),
                counts: None,
                duration: Duration::ZERO,
            });
        }
        Ok(binaries) => {
            let envoy = crate::setup::installed_envoy();
            for (i, bin) in binaries.iter().enumerate() {
                let mut cmd = Command::new(&bin.executable);
                cmd.args(&opts.args)
                    .current_dir(&bin.manifest_dir)
                    .env("CARGO_MANIFEST_DIR", &bin.manifest_dir);
                // The xDS and HTTP interop tests run the real Envoy that set-up installed.
                if let Some(envoy) = &envoy {
                    cmd.env("SHUNT_ENVOY_BIN", envoy);
                }
                println!(
                    "\n=== [{}/{}] {} ({})",
                    i + 1,
                    binaries.len(),
                    bin.name,
                    bin.executable.display()
                );
                rows.push(run_step(&bin.name, cmd, opts.binary_timeout));
            }
            let mut doc = crate::cargo();
            doc.args(["test", "--workspace", "--doc"]);
            if !opts.args.is_empty() {
                doc.arg("--").args(&opts.args);
            }
            println!("\n=== doc tests (cargo test --workspace --doc)");
            rows.push(run_step("doc tests", doc, opts.binary_timeout));
        }
    }

    // The fuzz targets, briefly each (`cargo xtask fuzz`): one step, failed by a crash.
    if opts.fuzz_seconds > 0 {
        let name = format!(
            "fuzz ({} targets x {} s)",
            crate::fuzz::TARGETS.len(),
            opts.fuzz_seconds
        );
        println!("\n=== {name}");
        // Set-up ran already; the build is most of the time a first run takes.
        let xtask = std::env::current_exe().unwrap_or_else(|_| "xtask".into());
        let mut fuzz = Command::new(xtask);
        fuzz.args(["fuzz", "--no-setup", "--seconds"])
            .arg(opts.fuzz_seconds.to_string());
        let runs = Duration::from_secs(2 * opts.fuzz_seconds * crate::fuzz::TARGETS.len() as u64);
        rows.push(run_step(&name, fuzz, opts.binary_timeout + runs));
    }

    let total = summary(&rows, start.elapsed());
    if total.failed > 0 {
        // The summary line stays the last line of the run: no error message after it.
        std::process::exit(1);
    }
    Ok(())
}

/// Prints the table and the final line; returns the total.
pub fn summary(rows: &[Row], elapsed: Duration) -> Counts {
    let mut total = Counts::default();
    let width = rows.iter().map(|r| r.name.len()).max().unwrap_or(0);
    println!("\n=== summary ({:.0} s)", elapsed.as_secs_f64());
    println!(
        "{:width$}  {:>6} {:>6} {:>7} {:>8}  status",
        "binary", "passed", "failed", "ignored", "time"
    );
    for row in rows {
        let c = row.effective();
        total.add(c);
        println!(
            "{:width$}  {:>6} {:>6} {:>7} {:>7.1}s  {}",
            row.name,
            c.passed,
            c.failed,
            c.ignored,
            row.duration.as_secs_f64(),
            row.status()
        );
    }
    println!("{}", final_line(total));
    let _ = std::io::stdout().flush();
    total
}

/// `N passed, N failed` and `, N ignored` when some were.
pub fn final_line(c: Counts) -> String {
    let mut line = format!("{} passed, {} failed", c.passed, c.failed);
    if c.ignored > 0 {
        line.push_str(&format!(", {} ignored", c.ignored));
    }
    line
}

/// `cargo test --workspace --no-run --message-format=json`: every test executable.
fn build_test_binaries() -> Result<Vec<TestBinary>> {
    let out = crate::cargo()
        .args([
            "test",
            "--workspace",
            "--no-run",
            "--message-format=json-render-diagnostics",
        ])
        .stderr(Stdio::inherit())
        .output()
        .context("running cargo test --no-run")?;
    if !out.status.success() {
        bail!("cargo test --workspace --no-run failed: {}", out.status);
    }
    let mut binaries = test_binaries(&String::from_utf8_lossy(&out.stdout))?;
    binaries.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(binaries)
}

/// The test executables in cargo's JSON messages: `compiler-artifact`s with
/// `profile.test` and an `executable`.
pub fn test_binaries(messages: &str) -> Result<Vec<TestBinary>> {
    let mut binaries = Vec::new();
    for line in messages.lines().filter(|l| l.starts_with('{')) {
        let msg: Value = serde_json::from_str(line).context("cargo's JSON message")?;
        if msg["reason"] != "compiler-artifact" || msg["profile"]["test"] != true {
            continue;
        }
        let Some(exe) = msg["executable"].as_str() else {
            continue;
        };
        let manifest = msg["manifest_path"]
            .as_str()
            .context("compiler-artifact without manifest_path")?;
        let manifest_dir = PathBuf::from(manifest)
            .parent()
            .context("manifest_path without a directory")?
            .to_path_buf();
        // package_id: `path+file:///work/x/tests#shunt-tests@0.1.0` (or `...#0.1.0`
        // when the directory is the package's name).
        let package = msg["package_id"]
            .as_str()
            .and_then(|id| id.rsplit_once('#'))
            .map(|(path, rest)| match rest.split_once('@') {
                Some((name, _)) => name.to_string(),
                None => path.rsplit('/').next().unwrap_or(path).to_string(),
            })
            .unwrap_or_default();
        let target = msg["target"]["name"].as_str().unwrap_or("?");
        let kind = msg["target"]["kind"][0].as_str().unwrap_or("?");
        binaries.push(TestBinary {
            name: format!("{package}/{target} ({kind})"),
            executable: exe.into(),
            manifest_dir,
        });
    }
    Ok(binaries)
}

/// libtest's `test result: ok. 3 passed; 1 failed; 2 ignored; 0 measured; 0 filtered
/// out; finished in 0.01s`, summed over every such line (`cargo test --doc` prints one a
/// crate).
pub fn parse_results(output: &str) -> Option<Counts> {
    let mut total: Option<Counts> = None;
    for line in output.lines() {
        let Some(rest) = line.trim().strip_prefix("test result: ") else {
            continue;
        };
        let mut c = Counts::default();
        for part in rest.split(';') {
            let words: Vec<&str> = part.split_whitespace().collect();
            // "ok. 3 passed" / "FAILED. 3 passed" / "1 failed" / "2 ignored"
            let (n, what) = match words.as_slice() {
                [_, n, what, ..] if words[0].ends_with('.') => (n, what),
                [n, what, ..] => (n, what),
                _ => continue,
            };
            let Ok(n) = n.parse::<u64>() else { continue };
            match *what {
                "passed" => c.passed = n,
                "failed" => c.failed = n,
                "ignored" => c.ignored = n,
                _ => {}
            }
        }
        total.get_or_insert_with(Counts::default).add(c);
    }
    total
}

/// The process group of the step running now (0: none), for [`on_interrupt`].
static RUNNING_GROUP: AtomicI32 = AtomicI32::new(0);

/// A test binary in its own process group no longer gets the terminal's Ctrl-C: on
/// SIGINT or SIGTERM, kill the running group, then exit as the signal would.
extern "C" fn on_interrupt(signal: libc::c_int) {
    let pgid = RUNNING_GROUP.load(Ordering::SeqCst);
    // SAFETY: kill(2) and _exit(2) are async-signal-safe.
    unsafe {
        if pgid > 0 {
            libc::kill(-pgid, libc::SIGKILL);
        }
        libc::_exit(128 + signal);
    }
}

fn forward_interrupts() {
    let handler = on_interrupt as extern "C" fn(libc::c_int) as libc::sighandler_t;
    // SAFETY: the handler only calls async-signal-safe functions.
    unsafe {
        libc::signal(libc::SIGINT, handler);
        libc::signal(libc::SIGTERM, handler);
    }
}

/// Runs one step in its own process group, its stdout echoed and kept (for the
/// `test result:` lines), its stderr passed through; kills the group after `timeout`.
pub fn run_step(name: &str, mut cmd: Command, timeout: Duration) -> Row {
    use std::os::unix::process::CommandExt;
    let start = Instant::now();
    cmd.process_group(0)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    let mut child = match cmd.spawn() {
        Ok(child) => child,
        Err(e) => {
            return Row {
                name: name.into(),
                ending: Ending::NotStarted(e.to_string()),
                counts: None,
                duration: start.elapsed(),
            };
        }
    };
    forward_interrupts();
    RUNNING_GROUP.store(child.id() as i32, Ordering::SeqCst);
    let output = Arc::new(Mutex::new(String::new()));
    let (done_tx, done_rx) = mpsc::channel();
    {
        let stdout = child.stdout.take().expect("stdout is piped");
        let output = Arc::clone(&output);
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                println!("{line}");
                let mut out = output.lock().unwrap();
                out.push_str(&line);
                out.push('\n');
            }
            let _ = done_tx.send(());
        });
    }
    let deadline = start + timeout;
    let ending = loop {
        match child.try_wait() {
            Ok(Some(status)) if status.success() => break Ending::Ok,
            Ok(Some(status)) => break Ending::Failed(status.to_string()),
            Ok(None) => {}
            Err(e) => break Ending::Failed(format!("waiting for it: {e}")),
        }
        if Instant::now() >= deadline {
            // The child is not reaped yet, so its pid is still its group's id.
            let pgid = child.id() as i32;
            // SAFETY: kill(2) with a negative pid signals that process group only.
            unsafe { libc::kill(-pgid, libc::SIGKILL) };
            let _ = child.wait();
            eprintln!(
                "xtask test: {name} ran longer than {} s: killed its process group",
                timeout.as_secs()
            );
            break Ending::TimedOut;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    RUNNING_GROUP.store(0, Ordering::SeqCst);
    // A process that left the group (or a daemon) may still hold the pipe: wait a
    // little for the rest of the output, not for ever.
    let _ = done_rx.recv_timeout(Duration::from_secs(10));
    let counts = parse_results(&output.lock().unwrap());
    Row {
        name: name.into(),
        ending,
        counts,
        duration: start.elapsed(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_libtest_result_lines() {
        let out = "running 3 tests\n\
            test a ... ok\n\
            test result: FAILED. 3 passed; 1 failed; 2 ignored; 0 measured; 5 filtered out; finished in 0.01s\n";
        assert_eq!(
            parse_results(out),
            Some(Counts {
                passed: 3,
                failed: 1,
                ignored: 2
            })
        );
        let doc = "test result: ok. 0 passed; 0 failed; 2 ignored; 0 measured; 0 filtered out; finished in 0.00s\n\
            Doc-tests x\n\
            test result: ok. 4 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out; finished in 0.00s\n";
        assert_eq!(
            parse_results(doc),
            Some(Counts {
                passed: 4,
                failed: 0,
                ignored: 2
            })
        );
        assert_eq!(parse_results("thread 'main' panicked\n"), None);
    }

    #[test]
    fn final_line_names_ignored_only_when_some_were() {
        let mut c = Counts {
            passed: 7,
            failed: 0,
            ignored: 0,
        };
        assert_eq!(final_line(c), "7 passed, 0 failed");
        c.ignored = 2;
        c.failed = 1;
        assert_eq!(final_line(c), "7 passed, 1 failed, 2 ignored");
    }

    #[test]
    fn a_crash_without_a_failed_test_counts_as_one_failure() {
        let row = Row {
            name: "x".into(),
            ending: Ending::Failed("signal: 11".into()),
            counts: Some(Counts {
                passed: 2,
                failed: 0,
                ignored: 0,
            }),
            duration: Duration::ZERO,
        };
        assert_eq!(row.effective().failed, 1);
        assert_eq!(row.effective().passed, 2);
    }

    #[test]
    fn a_failing_step_is_reported_and_the_next_still_runs() {
        let fail = run_step(
            "fails",
            {
                let mut c = Command::new("sh");
                c.args(["-c", "echo 'test result: FAILED. 1 passed; 2 failed; 0 ignored; 0 measured; 0 filtered out; finished in 0.00s'; exit 101"]);
                c
            },
            Duration::from_secs(30),
        );
        assert_eq!(fail.ending, Ending::Failed("exit status: 101".into()));
        assert_eq!(fail.effective().failed, 2);
        let ok = run_step(
            "passes",
            {
                let mut c = Command::new("sh");
                c.args(["-c", "echo 'test result: ok. 4 passed; 0 failed; 1 ignored; 0 measured; 0 filtered out; finished in 0.00s'"]);
                c
            },
            Duration::from_secs(30),
        );
        assert_eq!(ok.ending, Ending::Ok);
        assert_eq!(ok.effective().passed, 4);
    }

    #[test]
    fn a_hanging_step_times_out_and_its_whole_process_group_is_killed() {
        let marker = std::env::temp_dir().join(format!("xtask-runner-{}", std::process::id()));
        let _ = std::fs::remove_file(&marker);
        let mut cmd = Command::new("sh");
        // A grandchild in the background that would write the marker after 3 s, and a
        // foreground sleep that hangs; both must die at the 1 s limit.
        cmd.args([
            "-c",
            &format!("(sleep 3; touch {}) & sleep 600", marker.display()),
        ]);
        let start = Instant::now();
        let row = run_step("hangs", cmd, Duration::from_secs(1));
        assert_eq!(row.ending, Ending::TimedOut);
        assert!(
            start.elapsed() < Duration::from_secs(15),
            "{:?}",
            start.elapsed()
        );
        assert_eq!(row.effective().failed, 1);
        std::thread::sleep(Duration::from_secs(4));
        assert!(
            !marker.exists(),
            "the background grandchild outlived the time-out"
        );
    }

    #[test]
    fn finds_test_executables_in_cargo_messages() {
        let msgs = r#"{"reason":"compiler-artifact","package_id":"path+file:///w/tests#shunt-tests@0.1.0","manifest_path":"/w/tests/Cargo.toml","target":{"kind":["test"],"name":"xds"},"profile":{"test":true},"executable":"/w/target/debug/deps/xds-1"}
{"reason":"compiler-artifact","package_id":"path+file:///w/xtask#0.1.0","manifest_path":"/w/xtask/Cargo.toml","target":{"kind":["bin"],"name":"xtask"},"profile":{"test":true},"executable":"/w/target/debug/deps/xtask-2"}
{"reason":"compiler-artifact","package_id":"path+file:///w/tests#shunt-tests@0.1.0","manifest_path":"/w/tests/Cargo.toml","target":{"kind":["bin"],"name":"testapp"},"profile":{"test":false},"executable":"/w/target/debug/testapp"}
{"reason":"build-finished","success":true}"#;
        let bins = test_binaries(msgs).unwrap();
        let names: Vec<_> = bins.iter().map(|b| b.name.as_str()).collect();
        assert_eq!(names, ["shunt-tests/xds (test)", "xtask/xtask (bin)"]);
        assert_eq!(bins[0].manifest_dir, PathBuf::from("/w/tests"));
    }
}
