package source

import (
	"context"
	"errors"
	"fmt"
	"os"

	"github.com/opencontainers/go-digest"

	"github.com/weightd/weightd/pkg/content"
	"github.com/weightd/weightd/pkg/ref"
	"github.com/weightd/weightd/pkg/source/internal/fetch"
)

// Source resolves references of the kinds it knows to files and readers.
// Implementations must be safe for concurrent use.
type Source interface {
	// Resolve looks the reference up at its origin. A reference of a kind
	// the source does not handle is an error wrapping errors.ErrUnsupported;
	// errors that retrying cannot fix are wrapped with content.Permanent.
	Resolve(ctx context.Context, r ref.Ref) (*Resolution, error)
}

// Resolution is a reference resolved: a model's files or an image's blobs,
// and one opener per distinct blob (files with the same digest share a
// blob). Every digest named by Model.Files, Packed and Image.Blobs has its
// opener in Blobs.
type Resolution struct {
	// Model is the model and its files, each a blob stored as it is. For an
	// image, Name and Revision name the image and Files is empty.
	Model content.Model
	Blobs map[digest.Digest]content.RangeOpener
	// Packed lists layers whose files are inside an archive or compressed
	// (ModelPack tar, gzip or zstd layers): each layer is fetched as a blob,
	// then unpacked into the model's files.
	Packed []PackedLayer
	// Image is set when the reference is a container image: its blobs are
	// fetched and imported into the container runtime instead of being
	// materialised as a model directory.
	Image *Image
	// Verify, when set, checks what resolving could not (a digest another
	// node gave for a file the origin names otherwise): the queue calls it
	// once every blob is in the store, before the model is laid out, with
	// open reading a blob from the store. An error wrapping ErrUnverified
	// says the resolution was wrong and that the source will not give it
	// again, so the queue resolves once more.
	Verify func(open func(digest.Digest) (*os.File, error)) error
}

// ErrUnverified is Resolution.Verify's error for a resolution that does
// not match the content it names.
var ErrUnverified = errors.New("resolution does not match the content")

// Compression is how a packed layer is compressed.
type Compression string

// Layer compressions.
const (
	CompressionNone Compression = ""
	CompressionGzip Compression = "gzip"
	CompressionZstd Compression = "zstd"
)

// PackedLayer is one layer blob that holds model files in packed form.
type PackedLayer struct {
	content.Descriptor
	MediaType   string
	Compression Compression
	// Archive says the (decompressed) layer is a tar archive, extracted under
	// Path; else it is the content of the one file at Path.
	Archive bool
	// Path is a relative, clean path within the model: the file for a
	// non-archive layer, the directory an archive is extracted into ("" is
	// the model's root) for an archive.
	Path string
}

// Image is a container image for one platform, ready to import.
type Image struct {
	// Name is the image's name in the container runtime:
	// "registry/repository:tag", or "registry/repository@sha256:…" when the
	// reference has no tag.
	Name string
	// Target is the blob Name points at: an index or a manifest.
	Target ImageBlob
	// Blobs is every blob of the image for this platform, each once: the
	// index (if any), the manifest, the config and the layers, in that order.
	Blobs []ImageBlob
	// Public says the image was fetched without credentials: anyone may
	// have it.
	Public bool
}

// ImageBlob is one blob of an image, with its OCI or Docker media type.
type ImageBlob struct {
	content.Descriptor
	MediaType string
}

// Sources sends each reference to the source registered for its kind.
type Sources map[ref.Kind]Source

// Resolve resolves r with the source of its kind.
func (s Sources) Resolve(ctx context.Context, r ref.Ref) (*Resolution, error) {
	src, ok := s[r.Kind]
	if !ok {
		return nil, content.Permanent(fmt.Errorf("resolving %s: no source for %q references is configured: %w", r.Redacted(), r.Kind, errors.ErrUnsupported))
	}
	return src.Resolve(ctx, r)
}

// StatusError is an HTTP response status a source did not expect, as the
// http, hf, oci and s3 sources return it (errors.As finds it); it is
// defined with the range reading they share.
type StatusError = fetch.StatusError
