//! The S3 server's ceiling as the backup store's own client sees it: object_store (the same
//! builder settings as a backup target: unsigned payloads, loopback http), `parallel`
//! uploads of `count` objects of `mib` MiB at a time (multipart uploads of `part_mib` parts,
//! the way packs go up, one part at a time per object), then ranged GETs of all of them
//! streamed, `parallel` at a time, then deletes. Prints one line: `PUT_MiB/s GET_MiB/s`.
//!
//! ```text
//! s3_ceiling ENDPOINT BUCKET [--count 8] [--mib 64] [--part-mib 8] [--parallel 4]
//! ```
//!
//! benches/s3-ceiling.sh runs it beside boto3, whose PUTs are bound by Python on this
//! machine kind (about 60 MiB/s whatever the server), so the figure that bounds a backup is
//! this one.

use std::time::Instant;

use bytes::Bytes;
use clap::Parser;
use futures::{StreamExt, TryStreamExt};
use object_store::aws::AmazonS3Builder;
use object_store::path::Path;
use object_store::{GetOptions, GetRange, ObjectStore, ObjectStoreExt, PutPayload};

#[derive(Parser)]
struct Args {
    endpoint: String,
    bucket: String,
    #[arg(long, default_value_t = 8)]
    count: usize,
    #[arg(long, default_value_t = 64)]
    mib: usize,
    #[arg(long, default_value_t = 8)]
    part_mib: usize,
    #[arg(long, default_value_t = 4)]
    parallel: usize,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    let var = |k: &str, d: &str| std::env::var(k).unwrap_or_else(|_| d.to_string());
    let store = AmazonS3Builder::new()
        .with_unsigned_payload(true)
        .with_bucket_name(&a.bucket)
        .with_region(var("AWS_REGION", "us-east-1"))
        .with_access_key_id(var("AWS_ACCESS_KEY_ID", "testing"))
        .with_secret_access_key(var("AWS_SECRET_ACCESS_KEY", "testing"))
        .with_endpoint(&a.endpoint)
        .with_allow_http(true)
        .build()?;
    // Random bytes (an xorshift stream): nothing for a server to compress or deduplicate.
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    let body: Vec<u8> = (0..a.mib << 20)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    let body = Bytes::from(body);
    let part = a.part_mib << 20;
    let keys: Vec<Path> = (0..a.count)
        .map(|i| Path::from(format!("ceiling/{i}")))
        .collect();
    let store = &store;
    let t0 = Instant::now();
    futures::stream::iter(keys.iter().map(|k| {
        let body = body.clone();
        async move {
            // One request at a time per object: `parallel` requests in flight in all.
            let mut up = store.put_multipart(k).await?;
            for s in (0..body.len()).step_by(part) {
                let piece = body.slice(s..(s + part).min(body.len()));
                up.put_part(PutPayload::from(piece)).await?;
            }
            up.complete().await?;
            Ok::<_, object_store::Error>(())
        }
    }))
    .buffer_unordered(a.parallel)
    .try_collect::<Vec<_>>()
    .await?;
    let put = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    let total = a.mib as u64 * (1 << 20);
    futures::stream::iter(keys.iter().map(|k| async move {
        let opts = GetOptions {
            range: Some(GetRange::Bounded(0..total)),
            ..Default::default()
        };
        let mut s = store.get_opts(k, opts).await?.into_stream();
        let mut got = 0u64;
        while let Some(b) = s.next().await {
            got += b?.len() as u64;
        }
        anyhow::ensure!(got == total, "{k}: {got} of {total} bytes");
        Ok(())
    }))
    .buffer_unordered(a.parallel)
    .try_collect::<Vec<_>>()
    .await?;
    let get = t1.elapsed().as_secs_f64();
    for k in &keys {
        store.delete(k).await?;
    }
    let mib = (a.count * a.mib) as f64;
    println!("{:.1} {:.1}", mib / put, mib / get);
    Ok(())
}
