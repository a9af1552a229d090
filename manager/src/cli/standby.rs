//! `zebu volume create NAME --standby-from VOLUME` and `zebu volume activate NAME`: standby
//! (disaster-recovery) volumes that follow a source volume's backups until activated.
//!
//! `activate --wait` (the default) follows the volume until its activation is done (the
//! newest backup applied, standby mode ended) and prints the backup it holds.

use std::time::{Duration, Instant};

use anyhow::bail;
use hyper::Method;
use zebu_types::names::STANDBY_FROM_ANNOTATION;
use zebu_types::requests::standby::CreateStandby;
use zebu_types::resources::{RestoreState, Volume};

use super::args::Output;
use super::render;
use crate::client::{Client, ClientError, segment};

/// `POST /v1/standby`: the new standby volume.
pub async fn create(client: &Client, req: &CreateStandby) -> Result<Volume, ClientError> {
    client.call(Method::POST, "/v1/standby", Some(req)).await
}

/// `zebu volume activate NAME`.
pub async fn activate(
    client: &Client,
    out: Output,
    name: &str,
    wait: bool,
    timeout: u64,
) -> anyhow::Result<()> {
    let path = format!("/v1/volumes/{}/activate", segment(name));
    let mut v: Volume = client.call(Method::POST, &path, Client::NO_BODY).await?;
    let deadline = Instant::now() + Duration::from_secs(timeout);
    while wait && v.metadata.annotations.contains_key(STANDBY_FROM_ANNOTATION) {
        if let Some(r) = v.status.restore.as_ref()
            && r.state == RestoreState::Error
        {
            bail!(
                "volume {name:?}: the standby restore of backup {} failed: {}",
                r.backup,
                r.error
            );
        }
        if Instant::now() >= deadline {
            bail!("volume {name:?} is not activated after {timeout} s");
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        v = client.get_volume(name).await?;
    }
    match out {
        Output::Table => {
            let holds = v
                .status
                .restore
                .as_ref()
                .and_then(|r| r.restored.clone())
                .unwrap_or_else(|| "no backup".into());
            if v.metadata.annotations.contains_key(STANDBY_FROM_ANNOTATION) {
                println!("volume {name}: activation requested (holds {holds})");
            } else {
                println!("volume {name}: activated, holds {holds}");
            }
            Ok(())
        }
        _ => render::one(out, &v, render::volume_table),
    }
}
