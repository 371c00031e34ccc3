//! The workload certificate, as pilot-agent's secret manager keeps it: from the mesh CA
//! ([`client`]: key and CSR made here, `IstioCertificateService/CreateCertificate`,
//! rotation at the grace period, back-off on failure) or from mounted files ([`files`],
//! Istio's `/etc/certs`, watched). Either way the result is a [`Bundle`] published
//! through a [`CertificateProvider`], which the SDS server ([`super::sds`]) and the
//! in-process proxy ([`Bundle::tls_secrets`]) read.
//!
//! Start it with [`CertificateProvider::start_ca`] (options from the environment with
//! [`CaOptions::from_env`]) or [`CertificateProvider::start_files`]; both spawn a task on
//! the current tokio runtime and return at once. `provider.ready().await` waits for the
//! first certificate; `provider.subscribe()` sees every rotation.

pub mod bundle;
pub mod client;
pub mod csr;
pub mod files;
pub mod proto;

use std::sync::{Arc, Mutex};

pub use bundle::{Bundle, ROOT_CA, WORKLOAD_CERTIFICATE};
pub use client::CaOptions;
pub use csr::KeyType;
pub use files::FileOptions;
use tokio::sync::watch;

/// The current certificate bundle and its rotations. Cheap to clone; every clone sees
/// the same bundle.
#[derive(Clone)]
pub struct CertificateProvider {
    bundle: watch::Receiver<Option<Arc<Bundle>>>,
    status: Arc<Mutex<Status>>,
}

/// How the source has fared: what the status server and tests show.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Status {
    /// Bundles published so far (the first issuance counts).
    pub issued: u64,
    /// Failed attempts since the last success (0 when healthy).
    pub consecutive_failures: u32,
    /// Failed attempts in all.
    pub failures: u64,
    /// Why the last attempt failed, if it did.
    pub last_error: Option<String>,
}

/// The writing side, owned by the task that fetches or reloads certificates.
struct Publisher {
    bundle: watch::Sender<Option<Arc<Bundle>>>,
    status: Arc<Mutex<Status>>,
}

impl Publisher {
    fn new() -> (Publisher, CertificateProvider) {
        let (tx, rx) = watch::channel(None);
        let status = Arc::new(Mutex::new(Status::default()));
        (
            Publisher {
                bundle: tx,
                status: status.clone(),
            },
            CertificateProvider { bundle: rx, status },
        )
    }

    fn publish(&self, bundle: Bundle) {
        let mut status = self.status.lock().unwrap_or_else(|e| e.into_inner());
        status.issued += 1;
        status.consecutive_failures = 0;
        status.last_error = None;
        drop(status);
        self.bundle.send_replace(Some(Arc::new(bundle)));
    }

    /// Records a failure; returns how many in a row.
    fn failed(&self, error: String) -> u32 {
        let mut status = self.status.lock().unwrap_or_else(|e| e.into_inner());
        status.failures += 1;
        status.consecutive_failures += 1;
        status.last_error = Some(error);
        status.consecutive_failures
    }
}

impl CertificateProvider {
    /// Certificates from the mesh CA, fetched and rotated by a task spawned now.
    pub fn start_ca(options: CaOptions) -> (CertificateProvider, tokio::task::JoinHandle<()>) {
        let (publisher, provider) = Publisher::new();
        let task = tokio::spawn(client::run(options, publisher));
        (provider, task)
    }

    /// Certificates from mounted files, loaded now (an error if they are missing or
    /// wrong) and reloaded by a task spawned now whenever they change.
    pub fn start_files(
        options: FileOptions,
    ) -> anyhow::Result<(CertificateProvider, tokio::task::JoinHandle<()>)> {
        let (publisher, provider) = Publisher::new();
        let task = files::start(options, publisher)?;
        Ok((provider, task))
    }

    /// A provider that always has `bundle` (tests, and a proxy given its certificate).
    pub fn fixed(bundle: Bundle) -> CertificateProvider {
        let (publisher, provider) = Publisher::new();
        publisher.publish(bundle);
        // The sender may go: receivers keep the last value.
        provider
    }

    /// The bundle now, if one was obtained yet.
    pub fn current(&self) -> Option<Arc<Bundle>> {
        self.bundle.borrow().clone()
    }

    /// Waits for the first bundle (at once if there is one).
    pub async fn ready(&self) -> Arc<Bundle> {
        let mut rx = self.bundle.clone();
        loop {
            if let Some(bundle) = rx.borrow_and_update().clone() {
                return bundle;
            }
            if rx.changed().await.is_err() {
                // The source ended without a bundle: nothing will come.
                std::future::pending::<()>().await;
            }
        }
    }

    /// A receiver whose `changed().await` wakes on each bundle published from now on
    /// (`borrow()` has the current one).
    pub fn subscribe(&self) -> watch::Receiver<Option<Arc<Bundle>>> {
        let mut rx = self.bundle.clone();
        rx.mark_unchanged();
        rx
    }

    pub fn status(&self) -> Status {
        self.status
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}
