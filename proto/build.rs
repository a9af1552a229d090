//! Generates the Rust types and tonic services from `proto/*.proto`.
//!
//! `protoc` comes from the `protoc-bin-vendored` crate unless `PROTOC` is set, so a fresh
//! machine needs no system package to build.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut includes = vec![std::path::PathBuf::from("proto")];
    if std::env::var_os("PROTOC").is_none() {
        let protoc = protoc_bin_vendored::protoc_bin_path()?;
        // SAFETY: a build script is single-threaded here; nothing reads the environment
        // concurrently.
        unsafe { std::env::set_var("PROTOC", protoc) };
        includes.push(protoc_bin_vendored::include_path()?);
    }
    println!("cargo:rerun-if-changed=proto");
    tonic_prost_build::configure()
        .bytes(".zebu.replica.v1")
        .compile_protos(
            &[
                std::path::PathBuf::from("proto/replica.proto"),
                std::path::PathBuf::from("proto/engine.proto"),
            ],
            &includes,
        )?;
    // The CSI spec (vendored, see its header): no `bytes` mapping, its messages are small.
    tonic_prost_build::configure()
        .compile_protos(&[std::path::PathBuf::from("proto/csi.proto")], &includes)?;
    Ok(())
}
