// Package oci resolves oci:// references against OCI registries (the
// distribution API) with go-containerregistry: container images, for the
// container runtime, and ModelPack model artifacts, whose raw layers are a
// model's files and whose tar, gzip and zstd layers are unpacked. An index
// is resolved to the manifest of the source's Platform.
//
// Authentication: anonymous, basic or bearer-token, with credentials from a
// Docker config or a pull secret (kubelet's key matching), the agent's own
// only for the requesters source.AgentCredentials allows (RegistryAuth).
//
// Permanent: 4xx other than 408, 425 and 429 (404 also content.ErrNotFound,
// 401 and 403 content.ErrDenied), a token realm go-containerregistry
// refuses, manifests over the size limit or of unknown media types.
package oci
