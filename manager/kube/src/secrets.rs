//! Volume secrets as Kubernetes Secrets (issue 18; `zebu_types::secrets`): one Secret per
//! volume, named `zebu-volume-<volume>`, owned by the Volume (so the garbage collector
//! deletes it with the Volume), its value under the data key `secret`. A node that starts
//! the volume's processes copies it into a 0600 file of its own secrets directory (the
//! manager's `--data-dir`/secrets) and passes that path, never the secret.
//!
//! The manager's Role allows exactly what this needs on secrets: get, create, delete.

use std::collections::BTreeMap;
use std::path::PathBuf;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta as KubeMeta, OwnerReference};
use kube::Api;
use kube::api::{DeleteParams, PostParams};
use zebu_types::secrets::{FileSecrets, SECRET_KEY, SecretKeeper};
use zebu_types::store::{BoxFuture, Result, StoreError};
use zebu_types::{Kind, ObjectMeta};

use crate::errors::{Call, map};

/// The Secrets of one namespace, and where this node keeps its copies.
#[derive(Clone)]
pub struct KubeSecrets {
    api: Api<Secret>,
    local: Option<FileSecrets>,
}

impl KubeSecrets {
    pub fn new(client: kube::Client, namespace: &str, local_dir: Option<PathBuf>) -> Self {
        KubeSecrets {
            api: Api::namespaced(client, namespace),
            local: local_dir.map(FileSecrets::new),
        }
    }

    async fn get_value(&self, name: &str) -> Result<Vec<u8>> {
        let what = format!("secret {name}");
        let s = self
            .api
            .get(name)
            .await
            .map_err(|e| map(Call::new("get", Kind::Volume, &what), e))?;
        s.data
            .and_then(|mut d| d.remove(SECRET_KEY))
            .map(|b| b.0)
            .ok_or_else(|| {
                StoreError::invalid(
                    Some(Kind::Volume),
                    format!("Secret {name} has no data key {SECRET_KEY:?}"),
                )
            })
    }
}

impl SecretKeeper for KubeSecrets {
    fn create<'a>(
        &'a self,
        name: &'a str,
        owner: &'a ObjectMeta,
        value: &'a [u8],
    ) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            let secret = Secret {
                metadata: KubeMeta {
                    name: Some(name.to_string()),
                    labels: Some(BTreeMap::from([(
                        zebu_types::names::VOLUME_LABEL.to_string(),
                        owner.name.clone(),
                    )])),
                    owner_references: Some(vec![OwnerReference {
                        api_version: zebu_types::API_VERSION.to_string(),
                        kind: Kind::Volume.as_str().to_string(),
                        name: owner.name.clone(),
                        uid: owner.uid.clone(),
                        controller: Some(true),
                        block_owner_deletion: None,
                    }]),
                    ..KubeMeta::default()
                },
                data: Some(BTreeMap::from([(
                    SECRET_KEY.to_string(),
                    ByteString(value.to_vec()),
                )])),
                type_: Some("Opaque".into()),
                ..Secret::default()
            };
            let what = format!("secret {name}");
            self.api
                .create(&PostParams::default(), &secret)
                .await
                .map(|_| ())
                .map_err(|e| map(Call::new("create", Kind::Volume, &what), e))
        })
    }

    fn local_file<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<PathBuf>> {
        Box::pin(async move {
            let Some(local) = &self.local else {
                return Err(StoreError::invalid(
                    None,
                    format!("secret {name}: this process has no secrets directory for its copies"),
                ));
            };
            // Asked every time a process starts: a copy of a former volume's Secret of the
            // same name must never be passed on.
            let value = self.get_value(name).await?;
            let path = local.path(name)?;
            if std::fs::read(&path).is_ok_and(|have| have == value) {
                return Ok(path);
            }
            local.remove(name)?;
            local.write(name, &value)
        })
    }

    fn delete<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            if let Some(local) = &self.local {
                local.remove(name)?;
            }
            let what = format!("secret {name}");
            match self.api.delete(name, &DeleteParams::default()).await {
                Ok(_) => Ok(()),
                Err(e) => match map(Call::new("delete", Kind::Volume, &what), e) {
                    StoreError::NotFound { .. } => Ok(()),
                    e => Err(e),
                },
            }
        })
    }
}
