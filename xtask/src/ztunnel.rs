//! ztunnel, Istio's node proxy, as the mesh bench's peer: built from a copy of
//! istio/ztunnel's public source (`cargo xtask ztunnel --src DIR`; none of its code is
//! in this repository) and run as Istio runs it on a node, in shared in-pod mode, with
//! this module in istio-cni's place.
//!
//! The build: the source is copied to `~/.cache/shunt/ztunnel/src`, the one optional
//! dependency that only a git host serves (the BoringSSL provider, `tls-boring`) is
//! dropped from its manifest, protoc comes from Debian, and
//! `cargo build --release --features testing` builds it with its default TLS
//! provider (aws-lc) and jemalloc. `testing` is what ztunnel's own benches build with:
//! it brings `FAKE_CA`, an in-process CA, so no istiod is needed.
//!
//! The run (ztunnel's `ztunnel-redirect-inpod.sh` and istio-cni's job, written here):
//! ztunnel in the node's bridge namespace with `PROXY_MODE=shared`, a static local
//! config (`LOCAL_XDS_PATH`: the two pods as HBONE workloads on this node) and
//! `FAKE_CA=true`; this process listens on the ZDS socket (`INPOD_UDS`) and hands it
//! each pod's network namespace (`AddWorkload`, the netns fd by SCM_RIGHTS), then
//! `SnapshotSent`; each pod gets the in-pod redirect rules (outbound TCP to 15001,
//! inbound to 15006 except HBONE's 15008, ztunnel's own sockets marked 0x539 pass).

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use harness::{Node, Pod};
use prost::Message as _;
use shunt::node::enroll::wire;
use shunt::node::enroll::zds::proto;

/// The cached build: `~/.cache/shunt/ztunnel/ztunnel`.
pub fn cached_binary() -> PathBuf {
    crate::setup::cache_dir().join("ztunnel/ztunnel")
}

#[derive(clap::Args)]
pub struct ZtunnelArgs {
    /// A checkout of istio/ztunnel (default: $ZTUNNEL_SRC).
    #[arg(long, env = "ZTUNNEL_SRC")]
    src: PathBuf,
}

/// `cargo xtask ztunnel --src DIR`: builds ztunnel into the cache.
pub fn build_command(args: &ZtunnelArgs) -> Result<()> {
    let bin = build(&args.src)?;
    println!("{}", bin.display());
    Ok(())
}

/// Builds ztunnel from the source at `src` (a copy of it, in the cache); the binary.
pub fn build(src: &Path) -> Result<PathBuf> {
    ensure!(
        src.join("Cargo.toml").is_file() && src.join("proto/zds.proto").is_file(),
        "{} is not a checkout of istio/ztunnel (no Cargo.toml and proto/zds.proto)",
        src.display()
    );
    let root = crate::setup::cache_dir().join("ztunnel");
    let copy = root.join("src");
    std::fs::create_dir_all(&copy)?;
    // rsync would be nicer; cp -a of the tree without its build output is enough.
    crate::run_checked(
        Command::new("sh")
            .arg("-c")
            .arg(r#"cd "$1" && tar --exclude=./out --exclude=./target --exclude=./.git -cf - . | tar -xf - -C "$2""#)
            .arg("sh")
            .arg(src)
            .arg(&copy),
    )
    .context("copying the ztunnel source")?;
    drop_git_only_dependencies(&copy.join("Cargo.toml"))?;
    if which("protoc").is_none() {
        crate::setup::apt_install(&["protobuf-compiler"])?;
    }
    eprintln!(
        "xtask ztunnel: building {} (release, fat LTO: about 20 minutes on 2 cores)",
        copy.display()
    );
    crate::run_checked(
        Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
            .args([
                "build",
                "--release",
                "--bin",
                "ztunnel",
                "--features",
                "testing",
            ])
            .current_dir(&copy)
            .env("CARGO_TARGET_DIR", root.join("target"))
            .env_remove("RUSTFLAGS")
            .env_remove("CARGO_ENCODED_RUSTFLAGS"),
    )?;
    let bin = cached_binary();
    std::fs::copy(root.join("target/release/ztunnel"), &bin)
        .with_context(|| format!("copying the build to {}", bin.display()))?;
    Ok(bin)
}

/// Removes `boring-rustls-provider` (a git dependency, needed only by the `tls-boring`
/// feature) and that feature, so the build needs crates.io alone.
fn drop_git_only_dependencies(manifest: &Path) -> Result<()> {
    let text = std::fs::read_to_string(manifest)?;
    let kept: Vec<&str> = text
        .lines()
        .filter(|l| !l.starts_with("boring-rustls-provider =") && !l.starts_with("tls-boring ="))
        .collect();
    std::fs::write(manifest, kept.join("\n") + "\n")?;
    Ok(())
}

fn which(program: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join(program))
            .find(|p| p.is_file())
    })
}

/// The ztunnel binary to run: `explicit`, else `$ZTUNNEL_BIN`, else the cached build,
/// else a build from `src` (or `$ZTUNNEL_SRC`); `None` when there is none of these.
pub fn binary(explicit: Option<&Path>, src: Option<&Path>) -> Result<Option<PathBuf>> {
    if let Some(bin) = explicit
        .map(Path::to_owned)
        .or_else(|| std::env::var_os("ZTUNNEL_BIN").map(PathBuf::from))
    {
        ensure!(bin.is_file(), "no ztunnel binary at {}", bin.display());
        return Ok(Some(bin));
    }
    let cached = cached_binary();
    if cached.is_file() {
        return Ok(Some(cached));
    }
    match src
        .map(Path::to_owned)
        .or_else(|| std::env::var_os("ZTUNNEL_SRC").map(PathBuf::from))
    {
        Some(src) => build(&src).map(Some),
        None => Ok(None),
    }
}

/// The identity domain and namespace of the bench's workloads.
const NAMESPACE: &str = "default";
const SERVICE_ACCOUNT: &str = "default";
/// ztunnel's mark on its own sockets (`PACKET_MARK`, 1337) and the in-pod rules' marks.
const MARK: &str = "0x539/0xfff";
const CONNMARK: &str = "0x111/0xfff";

/// A running shared-mode ztunnel serving the given pods; stops it when dropped.
pub struct Ztunnel {
    child: Child,
    /// istio-cni's end of ZDS: closing it would make ztunnel wait for a new snapshot.
    _zds: UnixStream,
    dir: PathBuf,
}

impl Ztunnel {
    /// ztunnel in `node`'s bridge namespace serving `pods` (in-pod redirect rules in
    /// each), once every pod's outbound listener is up.
    pub fn start(bin: &Path, node: &Node, pods: &[&Pod]) -> Result<Ztunnel> {
        let dir = std::env::temp_dir().join(format!(
            "shunt-bench-ztunnel-{}-{}",
            std::process::id(),
            node.name()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)?;
        let config = dir.join("local.yaml");
        std::fs::write(&config, local_config(node.name(), pods))?;
        for pod in pods {
            redirect(pod).with_context(|| format!("in-pod rules in {}", pod.name()))?;
        }
        let socket = dir.join("ztunnel.sock");
        let listener = wire::bind(&socket).context("istio-cni's ZDS socket")?;
        let child = Command::new("nsenter")
            .arg(format!("--net={}", node.bridge_netns_path().display()))
            .arg(bin)
            .current_dir(&dir)
            .env("PROXY_MODE", "shared")
            .env("INPOD_UDS", &socket)
            .env("LOCAL_XDS_PATH", &config)
            .env("XDS_ADDRESS", "")
            .env("FAKE_CA", "true")
            .env("NODE_NAME", node.name())
            .env("ZTUNNEL_WORKER_THREADS", "2")
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(std::fs::File::create(dir.join("ztunnel.log"))?))
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        let mut child = KillOnDrop(Some(child));
        let zds = hand_over(&listener, child.0.as_mut().expect("just spawned"), pods)
            .with_context(|| format!("ztunnel's ZDS session; its log:\n{}", read_log(&dir)))?;
        let ztunnel = Ztunnel {
            child: child.0.take().expect("still held"),
            _zds: zds,
            dir,
        };
        // ztunnel binds the IPv6 wildcard, dual-stack.
        for pod in pods {
            harness::wait_for_port(
                pod,
                SocketAddr::from((std::net::Ipv6Addr::UNSPECIFIED, 15001)),
                Duration::from_secs(20),
            )
            .with_context(|| format!("ztunnel in {}; its log:\n{}", pod.name(), ztunnel.log()))?;
        }
        Ok(ztunnel)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn log(&self) -> String {
        read_log(&self.dir)
    }
}

fn read_log(dir: &Path) -> String {
    std::fs::read_to_string(dir.join("ztunnel.log")).unwrap_or_default()
}

/// A child killed if setup fails before [`Ztunnel`] owns it.
struct KillOnDrop(Option<Child>);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if let Some(mut child) = self.0.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// istio-cni's side: accept ztunnel, read its hello, add every pod with its netns, say
/// the snapshot is sent; each request must be acknowledged without an error.
fn hand_over(
    listener: &std::os::unix::net::UnixListener,
    child: &mut Child,
    pods: &[&Pod],
) -> Result<UnixStream> {
    {
        listener.set_nonblocking(true)?;
        let deadline = Instant::now() + Duration::from_secs(20);
        let conn = loop {
            match listener.accept() {
                Ok((conn, _)) => break conn,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if let Some(status) = child.try_wait()? {
                        bail!("ztunnel exited before connecting: {status}");
                    }
                    ensure!(Instant::now() < deadline, "ztunnel never connected");
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => return Err(e.into()),
            }
        };
        conn.set_nonblocking(false)?;
        conn.set_read_timeout(Some(Duration::from_secs(20)))?;
        let hello = proto::ZdsHello::decode(&wire::recv(conn.as_fd())?.bytes[..])?;
        ensure!(
            hello.version == proto::Version::V1 as i32,
            "ztunnel's ZDS hello has version {}",
            hello.version
        );
        for pod in pods {
            let netns: OwnedFd = std::fs::File::open(pod.netns_path())?.into();
            let add = proto::Request::Add(proto::AddWorkload {
                uid: workload_uid(pod),
                workload_info: Some(proto::WorkloadInfo {
                    name: pod.name().into(),
                    namespace: NAMESPACE.into(),
                    service_account: SERVICE_ACCOUNT.into(),
                }),
            });
            request(&conn, add, Some(&netns)).with_context(|| format!("adding {}", pod.name()))?;
        }
        request(
            &conn,
            proto::Request::SnapshotSent(proto::SnapshotSent {}),
            None,
        )?;
        Ok(conn)
    }
}

impl Drop for Ztunnel {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn request(conn: &UnixStream, payload: proto::Request, fd: Option<&OwnedFd>) -> Result<()> {
    let msg = proto::WorkloadRequest {
        payload: Some(payload),
    };
    wire::send(conn.as_fd(), &msg.encode_to_vec(), fd.map(AsFd::as_fd))?;
    let reply = proto::WorkloadResponse::decode(&wire::recv(conn.as_fd())?.bytes[..])?;
    match reply.payload {
        Some(proto::Response::Ack(ack)) if ack.error.is_empty() => Ok(()),
        Some(proto::Response::Ack(ack)) => bail!("ztunnel refused it: {}", ack.error),
        None => bail!("ztunnel answered without an ack"),
    }
}

fn workload_uid(pod: &Pod) -> String {
    format!("Kubernetes//Pod/{NAMESPACE}/{}", pod.name())
}

/// ztunnel's local config (`LOCAL_XDS_PATH`): each pod an HBONE workload on this node.
fn local_config(node: &str, pods: &[&Pod]) -> String {
    let mut yaml = String::from(
        "# Written by `cargo xtask bench mesh`: ztunnel's local config.\nworkloads:\n",
    );
    for pod in pods {
        let _ = write!(
            yaml,
            "- uid: {uid}\n  name: {name}\n  namespace: {NAMESPACE}\n  serviceAccount: {SERVICE_ACCOUNT}\n  \
             workloadIps: [\"{v4}\"]\n  protocol: HBONE\n  node: {node}\n  network: \"\"\n  services: {{}}\n",
            uid = workload_uid(pod),
            name = pod.name(),
            v4 = pod.ipv4(),
        );
    }
    yaml.push_str("policies: []\nservices: []\n");
    yaml
}

/// The in-pod redirect rules istio-cni installs for ztunnel (its
/// `ztunnel-redirect-inpod.sh`, IPv4): outbound TCP not to 127.0.0.1 goes to 15001,
/// inbound TCP but HBONE (15008) to 15006, ztunnel's own marked sockets pass, and the
/// connmark plus the local route bring back the replies to ztunnel's spoofed-source
/// (transparent) sockets.
fn redirect(pod: &Pod) -> Result<()> {
    let rules = format!(
        "*mangle\n:PREROUTING ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n:ISTIO_OUTPUT - [0:0]\n:ISTIO_PRERT - [0:0]\n\
         -A PREROUTING -j ISTIO_PRERT\n-A OUTPUT -j ISTIO_OUTPUT\n\
         -A ISTIO_OUTPUT -m connmark --mark {CONNMARK} -j CONNMARK --restore-mark --nfmask 0xffffffff --ctmask 0xffffffff\n\
         -A ISTIO_PRERT -m mark --mark {MARK} -j CONNMARK --set-xmark {CONNMARK}\n\
         COMMIT\n\
         *nat\n:PREROUTING ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n:ISTIO_OUTPUT - [0:0]\n:ISTIO_PRERT - [0:0]\n\
         -A OUTPUT -j ISTIO_OUTPUT\n-A PREROUTING -j ISTIO_PRERT\n\
         -A ISTIO_OUTPUT -p tcp -m mark --mark {CONNMARK} -j ACCEPT\n\
         -A ISTIO_OUTPUT ! -d 127.0.0.1/32 -o lo -j ACCEPT\n\
         -A ISTIO_OUTPUT ! -d 127.0.0.1/32 -p tcp -m mark ! --mark {MARK} -j REDIRECT --to-ports 15001\n\
         -A ISTIO_PRERT ! -d 127.0.0.1/32 -p tcp ! --dport 15008 -m mark ! --mark {MARK} -j REDIRECT --to-ports 15006\n\
         COMMIT\n"
    );
    crate::pods::run(
        pod.command("iptables-restore")
            .args(["--wait", "10", "--noflush"])
            .stdin_bytes(rules),
    )?;
    crate::pods::run(pod.command("ip").args([
        "route",
        "add",
        "local",
        "0.0.0.0/0",
        "dev",
        "lo",
        "table",
        "100",
    ]))?;
    crate::pods::run(pod.command("ip").args([
        "rule",
        "add",
        "fwmark",
        "0x111/0xfff",
        "pref",
        "32764",
        "lookup",
        "100",
    ]))?;
    Ok(())
}

/// How many connections ztunnel's metrics say it took over HBONE as the destination
/// (`istio_tcp_connections_opened_total{reporter="destination"}` summed), read in the
/// node's bridge namespace where its metrics port listens.
pub fn inbound_connections(node: &Node) -> Result<u64> {
    let out = Command::new("nsenter")
        .arg(format!("--net={}", node.bridge_netns_path().display()))
        .args([
            "curl",
            "-sS",
            "--max-time",
            "5",
            "http://127.0.0.1:15020/metrics",
        ])
        .output()
        .context("curl ztunnel's metrics")?;
    let text = String::from_utf8_lossy(&out.stdout);
    Ok(text
        .lines()
        .filter(|l| {
            l.starts_with("istio_tcp_connections_opened_total")
                && l.contains("reporter=\"destination\"")
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_git_dependency_and_its_feature_are_dropped() {
        let dir = std::env::temp_dir().join(format!("xtask-ztunnel-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let manifest = dir.join("Cargo.toml");
        std::fs::write(
            &manifest,
            "[features]\ntls-boring = [\"dep:boring\"]\ntls-ring = [\"dep:ring\"]\n\
             [dependencies]\nboring-rustls-provider = { git = \"x\", optional = true }\nboring = \"4\"\n",
        )
        .unwrap();
        drop_git_only_dependencies(&manifest).unwrap();
        let left = std::fs::read_to_string(&manifest).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(
            left,
            "[features]\ntls-ring = [\"dep:ring\"]\n[dependencies]\nboring = \"4\"\n"
        );
    }
}
