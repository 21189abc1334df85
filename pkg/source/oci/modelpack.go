package oci

import (
	"bytes"
	"cmp"
	"encoding/json"
	"fmt"
	"path"
	"slices"
	"strings"

	"github.com/opencontainers/go-digest"

	"github.com/weightd/weightd/pkg/content"
	"github.com/weightd/weightd/pkg/source"
	"github.com/weightd/weightd/pkg/source/internal/fetch"
)

// OCI, Docker and ModelPack media types this package knows.
const (
	MediaTypeOCIManifest    = "application/vnd.oci.image.manifest.v1+json"
	MediaTypeOCIIndex       = "application/vnd.oci.image.index.v1+json"
	MediaTypeDockerManifest = "application/vnd.docker.distribution.manifest.v2+json"
	MediaTypeDockerList     = "application/vnd.docker.distribution.manifest.list.v2+json"

	MediaTypeOCIConfig    = "application/vnd.oci.image.config.v1+json"
	MediaTypeDockerConfig = "application/vnd.docker.container.image.v1+json"

	// MediaTypeModelConfig is the config of a ModelPack model artifact as
	// the spec's drafts up to v0.0.6 name it; v0.0.7 renamed it to
	// application/vnd.cncf.model.config.v1+json, which is accepted too.
	MediaTypeModelConfig = "application/vnd.cnai.model.config.v1+json"
	// MediaTypeModelManifest is the artifactType of a ModelPack model up
	// to v0.0.6 of the spec (its cncf name from v0.0.7 on is accepted
	// too); some tools use it as the manifest's media type.
	MediaTypeModelManifest = "application/vnd.cnai.model.manifest.v1+json"

	// AnnotationModelFilepath is the layer annotation of a ModelPack model
	// that names the file (or, for an archive, the file or directory packed)
	// in the model, as the spec names it from v0.0.7 on.
	AnnotationModelFilepath = "org.cncf.model.filepath"
	// annotationModelFilepathDraft is AnnotationModelFilepath's name in the
	// spec's drafts up to v0.0.6, still written by tools built on them.
	annotationModelFilepathDraft = "org.cnai.model.filepath"
	// annotationTitle names a file in ORAS artifacts; used when a raw layer
	// has no AnnotationModelFilepath.
	annotationTitle = "org.opencontainers.image.title"
)

// Prefixes of ModelPack media types: "cnai" is the spec's up to v0.0.6,
// "cncf" the one it moved to in v0.0.7 (July 2025).
var modelTypePrefixes = []string{"application/vnd.cnai.model.", "application/vnd.cncf.model."}

// isModelType reports whether mt is a ModelPack config or manifest type.
func isModelType(mt string) bool {
	for _, p := range modelTypePrefixes {
		if rest, ok := strings.CutPrefix(mt, p); ok && (rest == "config.v1+json" || rest == "manifest.v1+json") {
			return true
		}
	}
	return false
}

// modelLayer says how a ModelPack layer of media type mt is packed:
// weight, weight.config, doc, code and dataset layers, raw, tar, tar+gzip or
// tar+zstd; plain OCI layer types are tar archives too.
func modelLayer(mt string) (c source.Compression, archive, ok bool) {
	if c, ok := imageLayer(mt); ok {
		return c, true, true
	}
	for _, p := range modelTypePrefixes {
		rest, found := strings.CutPrefix(mt, p)
		if !found {
			continue
		}
		kind, format, found := strings.Cut(rest, ".v1.")
		switch kind {
		case "weight", "weight.config", "doc", "code", "dataset":
		default:
			return "", false, false
		}
		switch format {
		case "raw":
			return source.CompressionNone, false, found
		case "tar":
			return source.CompressionNone, true, found
		case "tar+gzip":
			return source.CompressionGzip, true, found
		case "tar+zstd":
			return source.CompressionZstd, true, found
		}
	}
	return "", false, false
}

// imageLayer says how an image layer of media type mt is compressed.
func imageLayer(mt string) (source.Compression, bool) {
	switch mt {
	case "application/vnd.oci.image.layer.v1.tar":
		return source.CompressionNone, true
	case "application/vnd.oci.image.layer.v1.tar+gzip", "application/vnd.docker.image.rootfs.diff.tar.gzip":
		return source.CompressionGzip, true
	case "application/vnd.oci.image.layer.v1.tar+zstd":
		return source.CompressionZstd, true
	}
	return "", false
}

// isForeignLayer reports whether mt is a layer the registry does not serve
// (Windows base layers and other non-distributable content).
func isForeignLayer(mt string) bool {
	return mt == "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip" ||
		strings.HasPrefix(mt, "application/vnd.oci.image.layer.nondistributable.")
}

// ociDocument is an OCI or Docker image manifest or index, as much of it as
// weightd reads.
type ociDocument struct {
	SchemaVersion int               `json:"schemaVersion"`
	MediaType     string            `json:"mediaType"`
	ArtifactType  string            `json:"artifactType"`
	Config        *ociDescriptor    `json:"config"`
	Layers        []ociDescriptor   `json:"layers"`
	Manifests     []ociDescriptor   `json:"manifests"`
	Annotations   map[string]string `json:"annotations"`
}

// ociDescriptor is a descriptor in a manifest or index.
type ociDescriptor struct {
	MediaType    string            `json:"mediaType"`
	ArtifactType string            `json:"artifactType"`
	Digest       digest.Digest     `json:"digest"`
	Size         int64             `json:"size"`
	URLs         []string          `json:"urls"`
	Annotations  map[string]string `json:"annotations"`
	Platform     *ociPlatform      `json:"platform"`
}

func (d ociDescriptor) descriptor() content.Descriptor {
	return content.Descriptor{Digest: d.Digest, Size: d.Size}
}

// Limits of the documents parseOCIDocument accepts.
const (
	maxLayers    = 10_000
	maxManifests = 10_000
)

// parseOCIDocument parses a manifest or index and decides which it is from
// its mediaType, else the Content-Type it was served with, else its shape;
// doc.MediaType is set to the type decided (OCI's for a shape). It
// rejects Docker schema 1, unknown media types, documents that are both
// (manifests and layers or config), and malformed descriptors. Errors wrap
// content.ErrInvalid.
func parseOCIDocument(contentType string, body []byte) (doc *ociDocument, index bool, err error) {
	doc = new(ociDocument)
	if err := json.Unmarshal(body, doc); err != nil {
		return nil, false, fmt.Errorf("%w: manifest is not JSON: %v", content.ErrInvalid, err)
	}
	mt := doc.MediaType
	if mt == "" {
		mt = contentType
	}
	switch mt {
	case MediaTypeOCIIndex, MediaTypeDockerList:
		index = true
	case MediaTypeOCIManifest, MediaTypeDockerManifest, MediaTypeModelManifest, "application/vnd.cncf.model.manifest.v1+json":
	case "application/vnd.docker.distribution.manifest.v1+json", "application/vnd.docker.distribution.manifest.v1+prettyjws":
		return nil, false, fmt.Errorf("%w: Docker schema 1 manifests (%s) are not supported", content.ErrInvalid, mt)
	case "", "application/json", "application/octet-stream", "text/plain":
		// A registry that does not know the type: go by the shape.
		index = doc.Manifests != nil
		if !index && doc.Config == nil {
			return nil, false, fmt.Errorf("%w: manifest has no mediaType and neither manifests nor config", content.ErrInvalid)
		}
		mt = MediaTypeOCIManifest
		if index {
			mt = MediaTypeOCIIndex
		}
	default:
		return nil, false, fmt.Errorf("%w: unknown manifest media type %q", content.ErrInvalid, fetch.Truncate(mt))
	}
	doc.MediaType = mt
	if doc.SchemaVersion != 2 {
		return nil, false, fmt.Errorf("%w: manifest schemaVersion %d, want 2", content.ErrInvalid, doc.SchemaVersion)
	}
	if index {
		if doc.Config != nil || doc.Layers != nil {
			return nil, false, fmt.Errorf("%w: index %s also has a config or layers", content.ErrInvalid, mt)
		}
		if len(doc.Manifests) > maxManifests {
			return nil, false, fmt.Errorf("%w: index lists more than %d manifests", content.ErrInvalid, maxManifests)
		}
		for i, m := range doc.Manifests {
			if err := m.descriptor().Validate(); err != nil {
				return nil, false, fmt.Errorf("index entry %d: %w", i, err)
			}
		}
		return doc, true, nil
	}
	if doc.Manifests != nil {
		return nil, false, fmt.Errorf("%w: manifest %s also lists manifests", content.ErrInvalid, mt)
	}
	if doc.Config == nil {
		return nil, false, fmt.Errorf("%w: manifest has no config", content.ErrInvalid)
	}
	if err := doc.Config.descriptor().Validate(); err != nil {
		return nil, false, fmt.Errorf("config: %w", err)
	}
	if len(doc.Layers) > maxLayers {
		return nil, false, fmt.Errorf("%w: manifest lists more than %d layers", content.ErrInvalid, maxLayers)
	}
	for i, l := range doc.Layers {
		if err := l.descriptor().Validate(); err != nil {
			return nil, false, fmt.Errorf("layer %d: %w", i, err)
		}
	}
	return doc, false, nil
}

// isModelManifest reports whether a manifest is a ModelPack model artifact.
func isModelManifest(doc *ociDocument) bool {
	return isModelType(doc.ArtifactType) || isModelType(doc.MediaType) || (doc.Config != nil && isModelType(doc.Config.MediaType))
}

// modelContent lists a model artifact's files: raw layers as files, at the
// path their annotation names; archive and compressed layers as packed
// layers extracted at the model's root.
func modelContent(doc *ociDocument) ([]content.File, []source.PackedLayer, error) {
	var (
		files  []content.File
		packed []source.PackedLayer
	)
	for i, l := range doc.Layers {
		c, archive, ok := modelLayer(l.MediaType)
		if !ok {
			if isForeignLayer(l.MediaType) {
				return nil, nil, fmt.Errorf("%w: layer %d (%s) is a foreign layer (%s), which is not supported", content.ErrInvalid, i, l.Digest, l.MediaType)
			}
			return nil, nil, fmt.Errorf("%w: layer %d (%s) has unknown media type %q", content.ErrInvalid, i, l.Digest, fetch.Truncate(l.MediaType))
		}
		if archive {
			packed = append(packed, source.PackedLayer{Descriptor: l.descriptor(), MediaType: l.MediaType, Compression: c, Archive: true})
			continue
		}
		p := cmp.Or(l.Annotations[AnnotationModelFilepath], l.Annotations[annotationModelFilepathDraft], l.Annotations[annotationTitle])
		if p == "" {
			return nil, nil, fmt.Errorf("%w: raw layer %d (%s) has no %s (or %s) annotation", content.ErrInvalid, i, l.Digest, AnnotationModelFilepath, annotationModelFilepathDraft)
		}
		if err := content.ValidatePath(p); err != nil || path.Clean(p) != p {
			return nil, nil, fmt.Errorf("%w: raw layer %d (%s): file path %q is not a relative, clean path", content.ErrInvalid, i, l.Digest, fetch.Truncate(p))
		}
		files = append(files, content.File{Path: p, Descriptor: l.descriptor()})
	}
	if len(files) == 0 && len(packed) == 0 {
		return nil, nil, fmt.Errorf("%w: model artifact has no layers", content.ErrInvalid)
	}
	return files, packed, nil
}

// imageContent checks an image manifest's config and layers and returns its
// blobs: config, then layers, each once.
func imageContent(doc *ociDocument) ([]source.ImageBlob, error) {
	switch doc.Config.MediaType {
	case MediaTypeOCIConfig, MediaTypeDockerConfig:
	default:
		at := ""
		if doc.ArtifactType != "" {
			at = fmt.Sprintf(" (artifactType %q)", fetch.Truncate(doc.ArtifactType))
		}
		return nil, fmt.Errorf("%w: unknown config media type %q%s: neither an image nor a ModelPack model", content.ErrInvalid, fetch.Truncate(doc.Config.MediaType), at)
	}
	blobs := []source.ImageBlob{{Descriptor: doc.Config.descriptor(), MediaType: doc.Config.MediaType}}
	for i, l := range doc.Layers {
		if _, ok := imageLayer(l.MediaType); !ok {
			if isForeignLayer(l.MediaType) {
				return nil, fmt.Errorf("%w: layer %d (%s) is a foreign layer (%s) served from elsewhere than the registry, which is not supported", content.ErrInvalid, i, l.Digest, l.MediaType)
			}
			return nil, fmt.Errorf("%w: layer %d (%s) has unknown media type %q", content.ErrInvalid, i, l.Digest, fetch.Truncate(l.MediaType))
		}
		if !slices.ContainsFunc(blobs, func(b source.ImageBlob) bool { return b.Digest == l.Digest }) {
			blobs = append(blobs, source.ImageBlob{Descriptor: l.descriptor(), MediaType: l.MediaType})
		}
	}
	return blobs, nil
}

// contentTypeOf strips the parameters from a Content-Type header.
func contentTypeOf(h string) string {
	mt, _, _ := strings.Cut(h, ";")
	return strings.TrimSpace(mt)
}

// docMediaType is the media type of a manifest or index body: its own
// mediaType field, else the type it was served with.
func docMediaType(contentType string, body []byte) string {
	var v struct {
		MediaType string `json:"mediaType"`
	}
	if json.NewDecoder(bytes.NewReader(body)).Decode(&v) == nil && v.MediaType != "" {
		return v.MediaType
	}
	return contentType
}
