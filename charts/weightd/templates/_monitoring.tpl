{{/* Labels of the Prometheus Operator and Grafana objects. */}}
{{- define "weightd.monitoringLabels" -}}
{{ include "weightd.labels" (dict "ctx" . "component" "monitoring") }}
{{- with .Values.monitoring.release }}
release: {{ . }}
{{- end }}
{{- with .Values.monitoring.labels }}
{{ toYaml . }}
{{- end }}
{{- end -}}
