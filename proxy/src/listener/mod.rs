//! Accept loops for the outbound (15001) and inbound (15006) listeners.
//! (Owned by the proxy data-plane work; placeholder until it lands.)

#[derive(clap::Args, Debug)]
pub struct ProxyArgs {}

pub fn run(_args: ProxyArgs) -> anyhow::Result<()> {
    anyhow::bail!("not yet implemented")
}
