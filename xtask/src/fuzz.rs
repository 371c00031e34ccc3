//! `cargo xtask fuzz`: builds the libFuzzer targets of `fuzz/` and runs each for a
//! bounded time.
//!
//! The build needs no cargo-fuzz and no nightly toolchain: the stable toolchain under
//! `RUSTC_BOOTSTRAP=1` with the flags cargo-fuzz passes (SanitizerCoverage's inline 8-bit
//! counters, PC table and compare tracing, AddressSanitizer, `--cfg fuzzing`), for the
//! host target only (`--target` keeps build scripts and proc macros uninstrumented), in
//! `fuzz/target/`. `SHUNT_SKIP_EBPF=1`: the fuzzed code never loads eBPF.
//!
//! Each target runs over its corpus in the repository (`fuzz/corpus/<target>/`, seeds
//! only) with new inputs written to `fuzz/target/corpus/<target>/` (or into the
//! repository's corpus with `--save-corpus`); a crash input lands in
//! `fuzz/target/artifacts/<target>/` and fails the run, named in the report.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

/// Every target, in the order they run.
pub const TARGETS: &[&str] = &[
    "bootstrap",
    "yaml_loader",
    "xds_resource",
    "route_match",
    "http_request",
    "http1_response",
    "listener_sniff",
    "capture_flags",
    "dns_message",
    "peer_exchange",
];

/// What cargo-fuzz passes rustc (its defaults, with AddressSanitizer), and the linker
/// told to compress the line tables: nine executables of ~180 MB otherwise, most of it
/// debug info, and CI once ran out of disk building them.
const RUSTFLAGS: &str = "-Cpasses=sancov-module \
    -Cllvm-args=-sanitizer-coverage-level=4 \
    -Cllvm-args=-sanitizer-coverage-inline-8bit-counters \
    -Cllvm-args=-sanitizer-coverage-pc-table \
    -Cllvm-args=-sanitizer-coverage-trace-compares \
    --cfg fuzzing -Zsanitizer=address -Cdebug-assertions -Coverflow-checks \
    -Clink-arg=-Wl,--compress-debug-sections=zlib";

/// Options of `cargo xtask fuzz`.
pub struct Options {
    /// How long each target runs.
    pub seconds: u64,
    /// Which targets (empty: all).
    pub targets: Vec<String>,
    /// Write new corpus entries into `fuzz/corpus/<target>/` rather than a scratch dir.
    pub save_corpus: bool,
}

/// How one target's run went.
#[derive(Debug, Default, Clone)]
pub struct Outcome {
    pub execs: u64,
    pub seconds: f64,
    /// Inputs in the corpus at the end (`corp: N/..` of libFuzzer's last status line).
    pub corpus: u64,
    /// The input that crashed it (or made it time out, or run out of memory).
    pub crash: Option<String>,
    /// Its exit status, when not 0.
    pub failure: Option<String>,
}

fn fuzz_dir() -> PathBuf {
    crate::workspace_root().join("fuzz")
}

fn target_dir() -> PathBuf {
    fuzz_dir().join("target")
}

/// Builds the targets; returns where their executables are.
pub fn build(targets: &[&str]) -> Result<PathBuf> {
    let triple = crate::setup::host_triple()?;
    let mut cmd = crate::cargo();
    cmd.args(["build", "--release", "--manifest-path"])
        .arg(fuzz_dir().join("Cargo.toml"))
        .args(["--target", &triple]);
    for target in targets {
        cmd.args(["--bin", target]);
    }
    cmd.env("RUSTC_BOOTSTRAP", "1")
        .env("SHUNT_SKIP_EBPF", "1")
        .env("RUSTFLAGS", RUSTFLAGS)
        .env_remove("CARGO_ENCODED_RUSTFLAGS")
        .env("CARGO_TARGET_DIR", target_dir());
    let start = Instant::now();
    crate::run_checked(&mut cmd).context("building the fuzz targets")?;
    println!(
        "fuzz: built {} target(s) in {:.0} s",
        targets.len(),
        start.elapsed().as_secs_f64()
    );
    Ok(target_dir().join(triple).join("release"))
}

/// `cargo xtask fuzz`.
pub fn run(opts: &Options) -> Result<()> {
    let targets: Vec<&str> = if opts.targets.is_empty() {
        TARGETS.to_vec()
    } else {
        for t in &opts.targets {
            if !TARGETS.contains(&t.as_str()) {
                bail!(
                    "no fuzz target {t:?}; the targets are {}",
                    TARGETS.join(", ")
                );
            }
        }
        opts.targets.iter().map(String::as_str).collect()
    };
    let bin_dir = build(&targets)?;
    let mut outcomes = Vec::new();
    for target in &targets {
        let outcome = run_target(&bin_dir, target, opts)?;
        outcomes.push((*target, outcome));
    }
    println!("\n=== fuzz summary ({} s per target)", opts.seconds);
    println!(
        "{:<16} {:>12} {:>10} {:>8}  result",
        "target", "execs", "execs/s", "corpus"
    );
    for (target, o) in &outcomes {
        let rate = if o.seconds > 0.0 {
            o.execs as f64 / o.seconds
        } else {
            0.0
        };
        let result = match (&o.crash, &o.failure) {
            (Some(path), _) => format!("CRASH: {path}"),
            (None, Some(status)) => format!("FAILED ({status})"),
            (None, None) => "ok".into(),
        };
        println!(
            "{target:<16} {:>12} {rate:>10.0} {:>8}  {result}",
            o.execs, o.corpus
        );
    }
    let failed: Vec<&str> = outcomes
        .iter()
        .filter(|(_, o)| o.crash.is_some() || o.failure.is_some())
        .map(|(t, _)| *t)
        .collect();
    if !failed.is_empty() {
        bail!("fuzz target(s) failed: {}", failed.join(", "));
    }
    Ok(())
}

fn run_target(bin_dir: &Path, target: &str, opts: &Options) -> Result<Outcome> {
    let seeds = fuzz_dir().join("corpus").join(target);
    let scratch = target_dir().join("corpus").join(target);
    let artifacts = target_dir().join("artifacts").join(target);
    let logs = target_dir().join("logs");
    for dir in [&seeds, &scratch, &artifacts, &logs] {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    // libFuzzer writes new inputs into the first corpus directory it is given.
    let (first, second) = if opts.save_corpus {
        (&seeds, &scratch)
    } else {
        (&scratch, &seeds)
    };
    let log = logs.join(format!("{target}.log"));
    let mut cmd = Command::new(bin_dir.join(target));
    cmd.arg(first)
        .arg(second)
        .arg(format!("-max_total_time={}", opts.seconds))
        .arg(format!("-artifact_prefix={}/", artifacts.display()))
        // One input may take this long before it counts as a hang (a crash).
        .arg("-timeout=20")
        .arg("-rss_limit_mb=3072")
        .arg("-max_len=65536")
        .arg("-print_final_stats=1")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log)?);
    if std::env::var_os("ASAN_OPTIONS").is_none() {
        // Leaks are not what these targets look for, and a runtime's threads at exit
        // would be reported as such.
        cmd.env("ASAN_OPTIONS", "detect_leaks=0");
    }
    println!(
        "\n=== fuzz {target}: {} s (corpus {} + {}, log {})",
        opts.seconds,
        first.display(),
        second.display(),
        log.display()
    );
    let start = Instant::now();
    let status = cmd
        .status()
        .with_context(|| format!("starting {}", bin_dir.join(target).display()))?;
    let elapsed = start.elapsed();
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    let mut outcome = parse_log(&text, elapsed);
    if !status.success() {
        outcome.failure = Some(status.to_string());
        // The end of the log says what happened: the panic or sanitizer report.
        let lines: Vec<&str> = text.lines().collect();
        for line in &lines[lines.len().saturating_sub(40)..] {
            println!("  | {line}");
        }
    }
    Ok(outcome)
}

/// Reads libFuzzer's output: `-print_final_stats` (`stat::number_of_executed_units`),
/// its last `#N ... corp: C/..` status line, and `Test unit written to PATH` for a crash.
pub fn parse_log(text: &str, elapsed: Duration) -> Outcome {
    let mut outcome = Outcome {
        seconds: elapsed.as_secs_f64(),
        ..Outcome::default()
    };
    for line in text.lines() {
        if let Some(n) = line.strip_prefix("stat::number_of_executed_units:") {
            outcome.execs = n.trim().parse().unwrap_or(outcome.execs);
        } else if let Some(rest) = line.strip_prefix('#') {
            let mut words = rest.split_whitespace();
            if let Some(n) = words.next().and_then(|n| n.parse().ok()) {
                outcome.execs = outcome.execs.max(n);
            }
            if let Some(corp) = rest.split("corp: ").nth(1) {
                outcome.corpus = corp
                    .split('/')
                    .next()
                    .and_then(|c| c.parse().ok())
                    .unwrap_or(outcome.corpus);
            }
        } else if let Some(path) = line.split("Test unit written to ").nth(1) {
            // A unit over `-report_slow_units` (10 s) is written too, as a note: the
            // run goes on. Only a crash or a hang (`-timeout`, which ends the run)
            // fails; a target's first unit, paying its one-time set-up on a busy
            // machine, can be that slow.
            if !path.contains("/slow-unit-") {
                outcome.crash = Some(path.trim().to_owned());
            }
        }
    }
    outcome
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slow_unit_is_a_note_not_a_crash() {
        let log = "Slowest unit: 11 s:\n\
            artifact_prefix='/a/'; Test unit written to /a/slow-unit-ea10\n\
            stat::number_of_executed_units: 4\n";
        let outcome = parse_log(log, Duration::from_secs(11));
        assert_eq!(outcome.crash, None);
        assert_eq!(outcome.execs, 4);
    }

    #[test]
    fn reads_execs_corpus_and_crash_from_libfuzzers_output() {
        let log = "INFO: Seed: 1\n\
            #2\tINITED cov: 10 ft: 11 corp: 3/120b exec/s: 0 rss: 40Mb\n\
            #4096\tpulse  cov: 50 ft: 80 corp: 17/1Kb lim: 43 exec/s: 2048 rss: 60Mb\n\
            ==1== ERROR: libFuzzer: deadly signal\n\
            artifact_prefix='a/'; Test unit written to a/crash-abc\n\
            stat::number_of_executed_units: 4100\n";
        let o = parse_log(log, Duration::from_secs(2));
        assert_eq!(o.execs, 4100);
        assert_eq!(o.corpus, 17);
        assert_eq!(o.crash.as_deref(), Some("a/crash-abc"));
    }
}
