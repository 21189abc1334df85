package httpsource

import (
	"net/url"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/pkg/content"
)

func TestFileURL(t *testing.T) {
	t.Parallel()
	tests := []struct {
		manifest string
		file     ManifestFile
		want     string // "" for an error
	}{
		{"https://h.example/models/llama/model.json", ManifestFile{Path: "config.json"}, "https://h.example/models/llama/config.json"},
		{"https://h.example/models/llama/model.json?sig=1", ManifestFile{Path: "sub/w.bin"}, "https://h.example/models/llama/sub/w.bin"},
		{"https://h.example/model.json", ManifestFile{Path: "a b/c?d#e%f"}, "https://h.example/a%20b/c%3Fd%23e%25f"},
		{"https://h.example/m/model.json", ManifestFile{Path: "a:b"}, "https://h.example/m/a:b"},
		{"https://h.example/m/model.json", ManifestFile{Path: "x", URL: "../blobs/x?sig=2"}, "https://h.example/blobs/x?sig=2"},
		{"https://h.example/m/model.json", ManifestFile{Path: "x", URL: "/abs/x"}, "https://h.example/abs/x"},
		{"https://h.example/m/model.json", ManifestFile{Path: "x", URL: "//cdn.example/x"}, "https://cdn.example/x"},
		{"https://h.example/m/model.json", ManifestFile{Path: "x", URL: "https://bucket.example/x?X-Amz-Signature=s"}, "https://bucket.example/x?X-Amz-Signature=s"},
		{"http://h.example/m/model.json", ManifestFile{Path: "x", URL: "https://bucket.example/x"}, "https://bucket.example/x"},
		{"https://h.example/m/model.json", ManifestFile{Path: "x", URL: "http://bucket.example/x"}, ""}, // no downgrade
		{"https://h.example/m/model.json", ManifestFile{Path: "x", URL: "dir/"}, ""},                    // names no file
	}
	for _, tt := range tests {
		t.Run(tt.file.Path+" "+tt.file.URL, func(t *testing.T) {
			t.Parallel()
			base, err := url.Parse(tt.manifest)
			require.NoError(t, err)
			got, err := tt.file.fileURL(base)
			if tt.want == "" {
				assert.ErrorIs(t, err, content.ErrInvalid)
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tt.want, got.String())
		})
	}
}
