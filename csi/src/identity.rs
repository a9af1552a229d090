//! The CSI Identity service: who the plugin is, what it offers, and whether it is ready.

use tonic::{Request, Response, Status};
use zebu_manager::client::Client;
use zebu_proto::csi;
use zebu_proto::csi::plugin_capability::service::Type as ServiceCap;
use zebu_proto::csi::plugin_capability::volume_expansion::Type as Expansion;

/// The driver name (`CSIDriver` object, StorageClass `provisioner`).
pub const DRIVER_NAME: &str = "driver.zebu.io";

pub struct IdentityService {
    /// Set when the controller service runs: Probe is ready only when the manager answers.
    manager: Option<Client>,
}

impl IdentityService {
    pub fn new(manager: Option<Client>) -> Self {
        IdentityService { manager }
    }
}

#[tonic::async_trait]
impl csi::identity_server::Identity for IdentityService {
    async fn get_plugin_info(
        &self,
        _request: Request<csi::GetPluginInfoRequest>,
    ) -> Result<Response<csi::GetPluginInfoResponse>, Status> {
        Ok(Response::new(csi::GetPluginInfoResponse {
            name: DRIVER_NAME.to_string(),
            vendor_version: env!("CARGO_PKG_VERSION").to_string(),
            manifest: [("csiSpec".to_string(), csi::SPEC_VERSION.to_string())]
                .into_iter()
                .collect(),
        }))
    }

    async fn get_plugin_capabilities(
        &self,
        _request: Request<csi::GetPluginCapabilitiesRequest>,
    ) -> Result<Response<csi::GetPluginCapabilitiesResponse>, Status> {
        let service = |t: ServiceCap| csi::PluginCapability {
            r#type: Some(csi::plugin_capability::Type::Service(
                csi::plugin_capability::Service { r#type: t as i32 },
            )),
        };
        let expansion = |t: Expansion| csi::PluginCapability {
            r#type: Some(csi::plugin_capability::Type::VolumeExpansion(
                csi::plugin_capability::VolumeExpansion { r#type: t as i32 },
            )),
        };
        let mut capabilities = vec![];
        if self.manager.is_some() {
            capabilities.push(service(ServiceCap::ControllerService));
        }
        capabilities.extend([
            service(ServiceCap::VolumeAccessibilityConstraints),
            expansion(Expansion::Online),
            expansion(Expansion::Offline),
        ]);
        Ok(Response::new(csi::GetPluginCapabilitiesResponse {
            capabilities,
        }))
    }

    async fn probe(
        &self,
        _request: Request<csi::ProbeRequest>,
    ) -> Result<Response<csi::ProbeResponse>, Status> {
        if let Some(client) = &self.manager {
            client.list_nodes().await.map_err(|e| {
                Status::failed_precondition(format!("not ready: the manager does not answer: {e}"))
            })?;
        }
        Ok(Response::new(csi::ProbeResponse { ready: Some(true) }))
    }
}
