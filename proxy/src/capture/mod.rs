//! `shunt capture`: istio-init's job. (Being written.)

#[derive(clap::Args, Debug)]
pub struct CaptureArgs {}

pub fn run(_args: CaptureArgs) -> anyhow::Result<()> {
    anyhow::bail!("not yet implemented")
}
