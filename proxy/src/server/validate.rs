//! `shunt proxy --mode validate`: load and check the bootstrap, compile it as serving
//! would (so what shunt cannot serve is reported too, at its JSON path), check the xDS
//! sources as the client would open them, and print the report.

use std::io::Write;

use anyhow::Context;
use envoy_types::pb::envoy::config::bootstrap::v3::Bootstrap;

use shunt_config::{Diagnostic, Options, Report, Summary, check};

/// `--mode validate`: report on the bootstrap to stdout; an error if it is not valid.
/// Besides [`check`], the bootstrap is compiled as serving would compile it, so what
/// shunt cannot serve is reported too, at its JSON path.
pub fn run(options: &Options) -> anyhow::Result<()> {
    let (loaded, mut report) = check(options, &shunt_xds::snapshot::extensions::IMPLEMENTED)?;
    let stats = shunt_core::stats::Store::new();
    match shunt_xds::snapshot::compile(&loaded.bootstrap, &stats) {
        Ok(compiled) => report.add_compiled(&[], &compiled.warnings),
        Err(err) => report.add_compiled(&err.errors, &err.warnings),
    }
    // The xDS sources as the client would open them.
    if let Err(err) = shunt_xds::source::plan(&loaded.bootstrap) {
        let text = format!("{err:#}");
        let (path, message) = text
            .split_once(": ")
            .unwrap_or(("dynamic_resources", &text));
        let problem = Diagnostic::error(path, message);
        report.add_compiled(&[problem], &[]);
    }
    let mut out = std::io::stdout().lock();
    print_report(&mut out, options, &loaded.bootstrap, &report).context("writing the report")?;
    let errors = report.errors().count();
    if errors > 0 {
        anyhow::bail!("{}: invalid, {}", options.origin(), count(errors, "error"));
    }
    Ok(())
}

fn print_report(
    out: &mut impl Write,
    options: &Options,
    bootstrap: &Bootstrap,
    report: &Report,
) -> std::io::Result<()> {
    writeln!(out, "bootstrap: {}", options.origin())?;
    writeln!(out, "{}", Summary { bootstrap, options })?;
    for finding in &report.findings {
        writeln!(out, "{} {finding}", finding.severity.label())?;
    }
    let (errors, warnings) = (report.errors().count(), report.warnings().count());
    if report.is_valid() {
        writeln!(out, "OK: valid, {}", count(warnings, "warning"))
    } else {
        writeln!(
            out,
            "INVALID: {}, {}",
            count(errors, "error"),
            count(warnings, "warning")
        )
    }
}

fn count(n: usize, noun: &str) -> String {
    if n == 1 {
        format!("1 {noun}")
    } else {
        format!("{n} {noun}s")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_validate_report_reads_well() {
        let path =
            std::path::Path::new(shunt_config::testing::TESTDATA).join("istio-default_golden.json");
        let options = Options {
            drain_time: std::time::Duration::from_secs(600),
            parent_shutdown_time: std::time::Duration::from_secs(900),
            config_path: Some(path),
            ..Default::default()
        };
        let (loaded, report) =
            check(&options, &shunt_xds::snapshot::extensions::IMPLEMENTED).unwrap();
        let mut out = Vec::new();
        print_report(&mut out, &options, &loaded.bootstrap, &report).unwrap();
        let text = String::from_utf8(out).unwrap();
        assert!(text.contains("admin: 127.0.0.1:15000\n"), "{text}");
        assert!(
            text.contains("static resources: 2 listeners, 4 clusters, 0 secrets\n"),
            "{text}"
        );
        assert!(
            text.contains(
                "dynamic resources: ADS DELTA_GRPC to cluster xds-grpc; LDS over ADS; CDS over ADS\n"
            ),
            "{text}"
        );
        assert!(
            text.ends_with(&format!(
                "OK: valid, {} warnings\n",
                report.warnings().count()
            )),
            "{text}"
        );
    }
}
