//! The commands a pod's hooks run against its agent: `shunt agent wait` (the classic
//! shape's postStart hook, pilot-agent's `wait`: hold the app's container until the
//! proxy is ready) and `shunt agent request` (pilot-agent's `request`: the native
//! shape's preStop hook `POST drain`, and a Job's `POST quitquitquit`). Each is a short
//! process of its own that speaks HTTP to the agent's ports on localhost.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context as _;

use shunt_agent::status::Call;

#[derive(clap::Args, Debug)]
pub struct WaitArgs {
    /// Give up (exit non-zero) after this long.
    #[arg(long, default_value_t = 60, value_name = "N")]
    pub timeout_seconds: u64,
    /// Time allowed for one readiness request.
    #[arg(long, default_value_t = 500, value_name = "MS")]
    pub request_timeout_millis: u64,
    /// Time between two attempts.
    #[arg(long, default_value_t = 500, value_name = "MS")]
    pub period_millis: u64,
    /// The readiness URL (http only).
    #[arg(long, default_value = "http://localhost:15021/healthz/ready")]
    pub url: String,
}

/// The ports `request` may reach, as pilot-agent allows: the proxy's admin API, the
/// readiness port, the agent's status port and its debug port.
const REQUEST_PORTS: [u16; 4] = [15000, 15004, 15020, 15021];

#[derive(clap::Args, Debug)]
pub struct RequestArgs {
    /// The local port to send to (pilot-agent's --debug-port): 15000 (the proxy's
    /// admin API), 15004, 15020 (the agent: `drain`, `quitquitquit`) or 15021.
    #[arg(long, default_value_t = 15000, value_name = "PORT")]
    pub debug_port: u16,
    /// Time allowed for the answer.
    #[arg(long, default_value_t = 60, value_name = "SECONDS")]
    pub timeout_seconds: u64,
    /// GET, POST, ...
    pub method: String,
    /// The path, with or without its leading `/` (`drain`, `/quitquitquit`).
    pub path: String,
}

/// `shunt agent request`: one request to a local port; the answer's body goes to
/// stdout, and anything but a 2xx answer is an error.
pub fn run_request(args: &RequestArgs) -> anyhow::Result<()> {
    if !REQUEST_PORTS.contains(&args.debug_port) {
        anyhow::bail!(
            "--debug-port {}: not one of the agent's and the proxy's ports {REQUEST_PORTS:?}",
            args.debug_port
        );
    }
    let method = hyper::Method::from_bytes(args.method.to_ascii_uppercase().as_bytes())
        .with_context(|| format!("{:?} is not an HTTP method", args.method))?;
    let path = format!("/{}", args.path.trim_start_matches('/'));
    let to = SocketAddr::from(([127, 0, 0, 1], args.debug_port));
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let answer = runtime.block_on(async {
        let mut call = Call::get(to, &path, Duration::from_secs(args.timeout_seconds));
        call.method = method;
        call.host = Some("localhost");
        call.send().await
    })?;
    use std::io::Write as _;
    std::io::stdout().write_all(&answer.body)?;
    if !answer.status.is_success() {
        anyhow::bail!(
            "{} {path} on port {}: {}",
            args.method,
            args.debug_port,
            answer.status
        );
    }
    Ok(())
}

/// `shunt agent wait`: polls the readiness URL until it answers 200.
pub fn run_wait(args: &WaitArgs) -> anyhow::Result<()> {
    let uri: hyper::Uri = args
        .url
        .parse()
        .with_context(|| format!("--url {:?}", args.url))?;
    if uri.scheme_str() != Some("http") {
        anyhow::bail!("--url {:?}: only http:// URLs", args.url);
    }
    // An IPv6 literal comes bracketed.
    let host = uri
        .host()
        .context("--url has no host")?
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_owned();
    let port = uri.port_u16().unwrap_or(80);
    let path = uri.path_and_query().map_or("/".into(), |p| p.to_string());
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(args.timeout_seconds);
        let mut last = String::from("no attempt yet");
        eprintln!(
            "shunt agent wait: waiting for the proxy to be ready (timeout: {} seconds)",
            args.timeout_seconds
        );
        loop {
            tokio::select! {
                () = tokio::time::sleep_until(deadline) => anyhow::bail!(
                    "timeout waiting for the proxy to become ready; last error: {last}"
                ),
                () = tokio::time::sleep(Duration::from_millis(args.period_millis)) => {}
            }
            let targets: Vec<SocketAddr> =
                match tokio::net::lookup_host((host.as_str(), port)).await {
                    Ok(addrs) => addrs.collect(),
                    Err(err) => {
                        last = format!("resolving {host}: {err}");
                        continue;
                    }
                };
            if targets.is_empty() {
                last = format!("{host} has no address");
            }
            // `localhost` is ::1 and 127.0.0.1: the first that answers counts.
            for target in targets {
                let mut call = Call::get(
                    target,
                    &path,
                    Duration::from_millis(args.request_timeout_millis),
                );
                call.host = uri.authority().map(|a| a.as_str());
                match call.send().await {
                    Ok(answer) if answer.status == hyper::StatusCode::OK => {
                        eprintln!("shunt agent wait: the proxy is ready");
                        return Ok(());
                    }
                    Ok(answer) => {
                        last = format!("HTTP status code {}", answer.status.as_u16());
                        break;
                    }
                    Err(err) => last = format!("{err:#}"),
                }
            }
        }
    })
}
